"""patches/visualizer.patch: a well-formed unified diff that makes phantora_visualizer fall back to a
default CUDA stream for communication calls without one (NcclSend / NcclRecv)."""

from __future__ import annotations

import re

from fixtures.paths import ROOT

PATCH = ROOT / "patches" / "visualizer.patch"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def test_visualizer_patch_is_a_consistent_unified_diff():
    lines = PATCH.read_text().splitlines()
    assert lines[0] == "diff --git a/phantora/visualizer/src/main.rs b/phantora/visualizer/src/main.rs"
    assert "--- a/phantora/visualizer/src/main.rs" in lines and "+++ b/phantora/visualizer/src/main.rs" in lines
    hunks = [i for i, line in enumerate(lines) if line.startswith("@@")]
    assert hunks
    for n, start in enumerate(hunks):
        old_len, new_len = (int(g or 1) for g in HUNK.match(lines[start]).group(2, 4))
        body = lines[start + 1 : hunks[n + 1] if n + 1 < len(hunks) else len(lines)]
        assert sum(1 for b in body if b[:1] in (" ", "-")) == old_len
        assert sum(1 for b in body if b[:1] in (" ", "+")) == new_len


def test_visualizer_patch_replaces_the_stream_unwrap():
    text = PATCH.read_text()
    removed = [line[1:].strip() for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    assert removed == ["let stream = meta.get_cuda_stream().unwrap();"]
    assert ".unwrap_or(CudaStream { device: 0, id: 0 })" in added
    assert "use cuda_call::CudaStream;" in added

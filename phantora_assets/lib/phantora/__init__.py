"""Phantora's formats: the Chrome trace (reader, writer, compiled scanner), run.log, perf DB,
netconfig, run folders, and the Docker configs and launcher of a Phantora run."""

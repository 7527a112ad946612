"""The experiment framework: the runner (points, validation, resume, reports), results
files, report helpers, workdir locks, the CLI wrapper and the timers."""

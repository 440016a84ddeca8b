"""`furlong report`: a run's per-step metrics and per-episode records as report.md and report.html."""

"""Tools that read a run: replay, log, export/diff, report plots, utilisation, progress, bench."""

"""What every role shares: the delta and version formats as roles read them, JSONL event logs, bounded
running figures and Prometheus metrics."""

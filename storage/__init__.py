"""Object stores (local directory, S3) and the run's log layout."""

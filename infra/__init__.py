"""What surrounds a run: local S3 server bring-up, deployment files, fault injection, simulator."""

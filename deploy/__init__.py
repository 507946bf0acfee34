"""The operator's path: one-gpu run (deploy/run.sh), NUMA binding, images, monitoring."""

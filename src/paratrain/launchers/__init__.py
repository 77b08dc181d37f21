"""Generate cluster jobs (Slurm, Kubernetes, SkyPilot) from the same options as `paratrain train`."""

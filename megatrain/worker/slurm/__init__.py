"""The Slurm executor's parts: the sbatch script (script), Slurm's states mapped onto the job's
lifecycle (states) and the commands that talk to a cluster (commands)."""

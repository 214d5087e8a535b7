#!/usr/bin/env bash
# Run a megatrain scheduler on a Slurm cluster's login node (or any host where sbatch, squeue,
# scancel and sinfo reach the cluster): every placed job becomes one sbatch job (worker.slurm).
#
#   MEGATRAIN_DATABASE_URL=postgresql+psycopg://user:pass@db-host/megatrain \
#   MEGATRAIN_HOME=/shared/megatrain \
#   MEGATRAIN_SLURM_PARTITION=gpu MEGATRAIN_SLURM_ACCOUNT=ml \
#   deploy/slurm/run-scheduler.sh
#
# The compute nodes must reach the same database and object store, and see MEGATRAIN_HOME (run
# folders and per-node logs) on a shared filesystem; MEGATRAIN_SLURM_PYTHON names the interpreter
# (with megatrain installed) on the nodes when it is not this one's path.
set -euo pipefail

for cmd in sbatch squeue scancel sinfo scontrol; do
  command -v "${MEGATRAIN_SLURM_BIN_DIR:+$MEGATRAIN_SLURM_BIN_DIR/}$cmd" >/dev/null 2>&1 || {
    echo "error: $cmd not found (put Slurm's client commands on PATH or set MEGATRAIN_SLURM_BIN_DIR)" >&2
    exit 2
  }
done
: "${MEGATRAIN_DATABASE_URL:?set MEGATRAIN_DATABASE_URL to a database the compute nodes reach (PostgreSQL)}"
: "${MEGATRAIN_HOME:?set MEGATRAIN_HOME to a folder on a filesystem the compute nodes share}"
"${MEGATRAIN_SLURM_BIN_DIR:+$MEGATRAIN_SLURM_BIN_DIR/}sinfo" ${MEGATRAIN_SLURM_PARTITION:+--partition="$MEGATRAIN_SLURM_PARTITION"} >/dev/null

export MEGATRAIN_EXECUTOR=slurm
exec megatrain scheduler "$@"

"""The batch scripts ``ddiloco slurm submit`` writes to ``OUT/slurm/`` (issue 29; docs/deploy.md "SLURM").

``role.sbatch`` runs one role of the run - the syncer, or one learner - as its own job. The job's
environment is the submitting shell's plus the environment contract (workers/learner/env.py), so
the command takes no ddiloco arguments. When the role's process exits non-zero (killed, crashed,
out of memory; not exit status 2, a refused setting) the script requeues its own job, up to ``DDILOCO_SLURM_MAX_RESTARTS`` times
(``--requeue`` also lets SLURM requeue it when its node fails); nobody else's job is touched, and
the next life resumes from its record in the store (storage/learner_state.py; the syncer recovers
from the log). ``scancel`` stops a role for good: SLURM's SIGTERM reaches the process, which
drains and records where it stands, and the script does not requeue what was asked to stop.

``stop.sbatch`` runs once every learner's job has ended (``--dependency=afterany:...``; a requeued
job is pending again, not ended): it waits until the syncer has committed every learner's durable
deltas (``ddiloco slurm drain``, infra/slurm/drain.py), then signals the syncer's job with SIGTERM (the syncer commits what
it holds, then exits 0 and is not requeued), waits for it to end and writes the run's summary.

Variables the scripts read (set by infra/slurm/submit.py):

| variable                   | meaning                                                         |
|----------------------------|-----------------------------------------------------------------|
| DDILOCO_SLURM_ROLE         | ``syncer`` or the learner's id (the lines the script prints)    |
| DDILOCO_SLURM_MAX_RESTARTS | requeues of this job after a failed process                     |
| DDILOCO_SLURM_NODES        | nodes of a learner's torchrun group (> 1: ``srun`` + torchrun)  |
| DDILOCO_SLURM_NPROC        | ranks per node of that group                                    |
| DDILOCO_SLURM_PYTHON       | the interpreter (the submitting venv's, on a shared filesystem) |
| DDILOCO_SLURM_SYNCER_JOB   | stop.sbatch: the syncer's job id                                |
| DDILOCO_SLURM_EVAL_JOB     | stop.sbatch: the evaluator's job id (empty: none)               |
| DDILOCO_SLURM_OUT          | stop.sbatch: the run's output directory                         |
| DDILOCO_SLURM_DRAIN_S      | stop.sbatch: longest wait for the drain (600 s)                 |
| DDILOCO_SLURM_EVAL_STOP_S  | stop.sbatch: the evaluator's last evaluation, at most (300 s)   |
"""
from __future__ import annotations

ROLE_SBATCH = r"""#!/bin/bash
# One role of a decoupled-diloco run (written by `ddiloco slurm submit`; infra/slurm/scripts.py).
#SBATCH --requeue
#SBATCH --open-mode=append
set -u
life=${SLURM_RESTART_COUNT:-0}
role=${DDILOCO_SLURM_ROLE:?}
echo "ddiloco-slurm: ${role} job ${SLURM_JOB_ID} life ${life} on $(hostname) at $(date -u +%FT%TZ)"
cmd=("$@")
if [ "${DDILOCO_SLURM_NODES:-1}" -gt 1 ]; then
  # a learner group across nodes: one torchrun per node, rendezvous on the job's first node (where this
  # batch script runs), at the address SLURM itself reaches it by (NodeAddr; the node's name when none)
  # and on a port free there (a fixed one would collide with another learner's group on that node)
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  addr=$(scontrol show node "$head" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  py=${DDILOCO_SLURM_PYTHON:-python3}
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  if [ "$(basename "${cmd[0]}")" = "$(basename "$py")" ] || [ "${cmd[0]}" = python ] || [ "${cmd[0]}" = python3 ]; then
    cmd=("${cmd[@]:1}")
  fi
  cmd=(srun --nodes="$DDILOCO_SLURM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1
       "$py" -m torch.distributed.run --nnodes="$DDILOCO_SLURM_NODES" --nproc-per-node="${DDILOCO_SLURM_NPROC:-1}"
       --rdzv-backend=c10d --rdzv-endpoint="${addr:-$head}:${port}" --rdzv-id="$SLURM_JOB_ID" "${cmd[@]}")
  echo "ddiloco-slurm: ${role} is a torchrun group on ${DDILOCO_SLURM_NODES} nodes," \
       "rendezvous at ${addr:-$head}:${port}"
fi
stopping=
child=
trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
"${cmd[@]}" &
child=$!
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break    # wait came back for a trapped signal: the process still runs
done
echo "ddiloco-slurm: ${role} exited ${rc} at $(date -u +%FT%TZ)"
if [ "$rc" -eq 2 ]; then
  echo "ddiloco-slurm: ${role} refused its settings (exit 2): not requeued; fix them and submit again"
elif [ "$rc" -ne 0 ] && [ -z "$stopping" ]; then
  if [ "$life" -lt "${DDILOCO_SLURM_MAX_RESTARTS:-0}" ]; then
    echo "ddiloco-slurm: ${role} requeued (life $((life + 1)) of at most $((DDILOCO_SLURM_MAX_RESTARTS + 1)))"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "ddiloco-slurm: scontrol requeue failed"
  else
    echo "ddiloco-slurm: ${role} gave up after ${life} restarts"
  fi
fi
exit "$rc"
"""

STOP_SBATCH = r"""#!/bin/bash
# Ends a decoupled-diloco run once every learner's job has ended (written by `ddiloco slurm submit`).
#SBATCH --open-mode=append
set -u
syncer=${DDILOCO_SLURM_SYNCER_JOB:?}
py=${DDILOCO_SLURM_PYTHON:-python3}
echo "ddiloco-slurm: every learner ended; waiting for the syncer (job ${syncer}) to commit their deltas"
# their last deltas are often spilled in the final steps: stopping the syncer before it merged them
# would leave them durable but in no commit (infra/slurm/drain.py)
"$py" -m workers.cli slurm drain "${DDILOCO_SLURM_OUT:?}" --timeout "${DDILOCO_SLURM_DRAIN_S:-600}"
echo "ddiloco-slurm: stopping the syncer (job ${syncer}) at $(date -u +%FT%TZ)"
# scancel: SIGTERM to the syncer's process (and its batch shell, which forwards it), SIGKILL after the
# site's KillWait (30 s by default) - bounded even if the syncer hangs in its shutdown (seen once in
# four runs of tests/test_slurm.py on a loaded machine; the drain above already committed everything)
scancel "$syncer"
while squeue -h -j "$syncer" -o %T 2>/dev/null | grep -q .; do
  sleep 2
done
evaluator=${DDILOCO_SLURM_EVAL_JOB:-}
if [ -n "$evaluator" ]; then
  echo "ddiloco-slurm: syncer ended; stopping the evaluator (job ${evaluator}) after its last evaluation"
  scancel --full --signal=TERM "$evaluator"
  waited=0
  while squeue -h -j "$evaluator" -o %T 2>/dev/null | grep -q .; do
    sleep 2
    waited=$((waited + 2))
    if [ "$waited" -ge "${DDILOCO_SLURM_EVAL_STOP_S:-300}" ]; then scancel "$evaluator"; fi
  done
fi
echo "ddiloco-slurm: writing the summary"
exec "$py" -m workers.cli slurm summary "${DDILOCO_SLURM_OUT:?}"
"""

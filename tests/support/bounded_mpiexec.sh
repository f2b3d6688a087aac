#!/bin/bash
# bounded_mpiexec.sh MPIEXEC ARGS...: runs an MPI job and returns once its ranks are gone.
#
# For the error-path tests, whose ranks end in MPI_Abort: Open MPI 4.1's mpiexec can then deadlock in
# its own teardown (PMIx_server_finalize, seen about 1 run in 10 here) after every rank has exited.
# The job under test did end; the launcher did not. That is reported here and the launcher killed,
# instead of the test timing out. A job whose ranks are still alive is never cut short.
"$@" &
launcher=$!
idle=0
while kill -0 "$launcher" 2>/dev/null; do
  # On one machine the ranks are mpiexec's children; a hung mpiexec leaves them as zombies.
  if [ -z "$(ps --ppid "$launcher" -o stat= | grep -v '^Z')" ]; then
    idle=$((idle + 1))
    if [ "$idle" -ge 100 ]; then  # 10 s without a rank
      echo "bounded_mpiexec: every rank ended 10 s ago but mpiexec has not exited (an Open MPI teardown hang); killing it" >&2
      kill -9 "$launcher" 2>/dev/null
      wait "$launcher" 2>/dev/null
      exit 125
    fi
  else
    idle=0
  fi
  sleep 0.1
done
wait "$launcher"

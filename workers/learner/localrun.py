"""``torchrun`` for a learner group on one host whose every listener is on 127.0.0.1.

    python -m workers.learner.localrun --nproc-per-node 2 -m workers.cli learner --store ... --id l0

takes the same arguments as ``python -m torch.distributed.run`` (torchrun) and runs it, with two
differences, both about who can connect to the group:

- torchrun's rendezvous store (a TCPStore in the agent process) binds the wildcard address even
  with ``--master-addr 127.0.0.1``; here the store's listening socket is opened first, bound to
  127.0.0.1, and handed to the TCPStore (``master_listen_fd``), which torchrun's static rendezvous
  then reuses (``multi_tenant``). The port is the one that socket got, so there is no race for it;
- gloo's sockets use the loopback interface (``GLOO_SOCKET_IFNAME``) unless the caller set one;
- the script's own arguments are handed over as they are: torchrun's parser would take ``--log``
  (the learner's event log) as an abbreviation of its ``--log-dir``/``--logs-specs`` and stop.

``--master-addr``/``--master-port``/``--rdzv-*``/``--nnodes``/``--standalone`` are refused: a
group spanning hosts uses torchrun itself (docs/running.md "A learner under torchrun").
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

REFUSED = ("--master-addr", "--master_addr", "--master-port", "--master_port", "--rdzv", "--nnodes", "--standalone",
           "--node-rank", "--node_rank")


def loopback_interface() -> str | None:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS), if one is found."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def torchrun_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(torchrun's arguments up to and including the script or module, the script's arguments)``.
    The script is the word after ``-m``/``--module``, or the first word ending in ``.py``.
    ValueError if there is none, or if a launcher argument would take the group off loopback."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module") and i + 1 < len(argv):
            return argv[:i + 2], argv[i + 2:]
        if arg.endswith(".py"):
            return argv[:i + 1], argv[i + 1:]
        if arg.startswith(REFUSED):
            raise ValueError(f"{arg}: this launcher keeps the group on 127.0.0.1; for a group across hosts use "
                             "torchrun itself")
    raise ValueError("no script: give `-m MODULE ...` or `script.py ...` after the launcher's options")


def main(argv: list[str] | None = None) -> None:
    own, script_args = torchrun_argv(list(sys.argv[1:] if argv is None else argv))
    import torch.distributed as dist
    from torch.distributed import run
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # The TCPStore owns the socket from here on (it closes it). Kept referenced for the whole run:
    # torchrun's own TCPStore (same port, multi_tenant) finds this one instead of binding anew.
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(minutes=30), wait_for_workers=False,
                          multi_tenant=True, master_listen_fd=sock.detach())
    args = run.parse_args(["--master-addr", "127.0.0.1", "--master-port", str(port), *own])
    args.training_script_args = script_args
    from torch.distributed.elastic.multiprocessing.api import SignalException
    try:
        run.run(args)
    except SignalException as exc:
        # torchrun has already passed the signal on and waited for the ranks: they leave together at
        # a step boundary and rank 0 drains its deltas (workers/learner/group.py). One line, no trace.
        print(f"localrun: stopped by signal {int(exc.sigval)}; the ranks were told to leave", file=sys.stderr)
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        del store


if __name__ == "__main__":
    main()

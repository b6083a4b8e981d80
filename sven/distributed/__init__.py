"""Launch, liveness and collectives of a multi-process run.

How a run joins its job, in the order things happen:

- :mod:`sven.distributed.launcher`: which launcher started the process (torchrun, srun,
  mpirun or none) and what it says, as a
  :class:`~sven.distributed.launcher.LaunchInfo`
  (:func:`~sven.distributed.launcher.detect_launcher`); pure functions of the
  environment.
- :mod:`sven.distributed.slurm`: SLURM's host lists, node addresses and the job's
  rendezvous port.
- :mod:`sven.distributed.rendezvous`: the rendezvous address where the launcher gives
  none: this host's addresses, a free port, the MPI probe.
- :mod:`sven.distributed.process_group`: the process group
  (:func:`~sven.distributed.process_group.init_distributed`), this rank's device and
  :class:`~sven.distributed.process_group.DistContext`, which tears the group down.
- :mod:`sven.distributed.liveness`: heartbeats in the rendezvous store and the
  diagnosis of a rank that died or hung.
- :mod:`sven.distributed.collectives`: :class:`~sven.distributed.collectives.DistError`,
  :func:`~sven.distributed.collectives.barrier_or_die` and the small collective helpers.
- :mod:`sven.distributed.grads`: the gradient all-reduce of the training step.
- :mod:`sven.distributed.native_log`: torch's C++ output to a per-rank log file rather
  than the terminal.
- :mod:`sven.distributed.selfcheck`: ``python -m sven.distributed``, the self-check of a
  launch: every rank joins, all-reduces and prints one line (e.g.
  ``srun -n 4 python -m sven.distributed``).
"""

"""Launch, liveness and collectives of a multi-process run.

- :mod:`sven.distributed.launch`: which launcher started the process, the master
  address, the process group (:func:`~sven.distributed.launch.init_distributed`,
  :class:`~sven.distributed.launch.DistContext`) and the per-rank native log.
- :mod:`sven.distributed.liveness`: heartbeats in the rendezvous store and the
  diagnosis of a rank that died or hung.
- :mod:`sven.distributed.collectives`: :class:`~sven.distributed.collectives.DistError`,
  :func:`~sven.distributed.collectives.barrier_or_die` and the small collective helpers.

``sven.dist`` re-exports all of them under their old names (``python -m sven.dist`` is
the launch self-check).
"""

"""What a built or trained run is used for, each task on the run's public members
(:class:`~sven.tasks.run.Run`; no task imports the trainer).

Link prediction on the run loop (``link``), node classification on a link-prediction
encoder (``nodeclass``), and the replay of a saved run that answers questions about any
time: scores, top-k and embeddings (``predict``, on ``replay`` and on the checkpoint's
node state; raw ids through ``ids``).
"""

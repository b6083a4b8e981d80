"""What a trained model is used for, beyond link prediction's own training.

Node classification on a link-prediction encoder (``nodeclass``), and the replay of a
saved run that answers questions about any time: scores, top-k and embeddings
(``predict``, on ``replay`` and on the checkpoint's node state; raw ids through ``ids``).
"""

"""Train TGN on events held in a pandas DataFrame (run: python docs/examples/dataframe_tgn.py).

Any table with a source, a destination and a time column works: ids may be integers or
strings, times numbers or datetimes, extra numeric columns become edge features.
``OUT`` (default: a temporary folder) receives the store and the run.
"""

import os
import tempfile

import numpy as np
import pandas as pd

import sven
from sven.datasets import from_dataframe

# A stand-in for your own events: 3000 messages among 50 users who mostly write to
# the same two friends, so that memory helps predict who comes next.
rng = np.random.default_rng(0)
sender = rng.integers(0, 50, 3000)
friends = rng.integers(0, 50, (50, 2))
df = pd.DataFrame(
    {
        "sender": [f"user{s}" for s in sender],
        "receiver": [f"user{r}" for r in friends[sender, rng.integers(0, 2, 3000)]],
        "sent_at": pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.random(3000), unit="D"),
        "length": rng.random(3000),
    }
)

out = os.environ.get("OUT") or tempfile.mkdtemp()
# The ten lines that matter: DataFrame -> event store -> trained model.
store = from_dataframe(
    df, f"{out}/store", src="sender", dst="receiver", time="sent_at", feat=["length"]
)
print(store)  # TemporalEvents('store', events=3000, nodes=50, bipartite=False)
summary = sven.Trainer(
    None,
    [f"data.path={out}/store", f"out={out}/run", "train.epochs=3", "train.lr=0.001",
     "model.memory_dim=32", "model.embed_dim=32", "model.time_dim=16", "quiet=true"],
).fit()  # fmt: skip
print(f"test AP {summary['test_ap']:.3f}; metrics per epoch in {out}/run/metrics.jsonl")

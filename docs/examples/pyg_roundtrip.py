"""To and from PyG's ``TemporalData`` (run: python docs/examples/pyg_roundtrip.py).

``TemporalEvents.from_pyg`` writes a ``TemporalData`` (``src``, ``dst``, ``t``, and
optional ``msg``, ``y``, ``x``) as an event store that ``sven train`` reads;
``TemporalEvents.to_pyg`` turns any store back into a ``TemporalData``, e.g. to compare
with PyG's own TGN example on the same events.
"""

import os
import tempfile

import torch
from torch_geometric.data import TemporalData

import sven
from sven.datasets.store import TemporalEvents

# A TemporalData as PyG's datasets provide it (JODIE's Wikipedia, say): compact ids,
# sorted times, edge features in ``msg``.
g = torch.Generator().manual_seed(0)
E, N = 2000, 40
src = torch.randint(0, N, (E,), generator=g)
data = TemporalData(
    src=src,
    dst=(src + torch.randint(1, 4, (E,), generator=g)) % N,  # nodes talk to near neighbours
    t=torch.sort(torch.randint(0, 100_000, (E,), generator=g)).values,
    msg=torch.rand(E, 4, generator=g),
)

out = os.environ.get("OUT") or tempfile.mkdtemp()
store = TemporalEvents.from_pyg(data, f"{out}/store")  # TemporalData -> event store
summary = sven.Trainer(
    None,
    [f"data.path={out}/store", f"out={out}/run", "train.epochs=2", "train.lr=0.003", "quiet=true",
     "model.memory_dim=16", "model.embed_dim=16", "model.time_dim=8"],
).fit()  # fmt: skip
print(f"test AP {summary['test_ap']:.3f}")

back = TemporalEvents.load(f"{out}/store").to_pyg()  # event store -> TemporalData
assert torch.equal(back.src, data.src) and torch.equal(back.dst, data.dst)
assert torch.equal(back.t, data.t) and torch.allclose(back.msg, data.msg)
print(back)  # TemporalData(src=[2000], dst=[2000], t=[2000], msg=[2000, 4])

"""dattri (TRAIS-Lab, PyPI ``dattri``) on the shared workload, through its public API.

dattri's hook-based attributors track ``nn.Linear``, so each block ``Conv1D`` becomes the equal
``nn.Linear``. Loss: next-token cross-entropy summed per sequence.

* ``graddot-proj``: ``LoGraAttributor(hessian="Identity", proj_dim=256)`` — a factored Gaussian
  projection to 16x16 = 256 numbers per layer; ``build`` = ``cache`` over the training batches
  (its ``batch_metadata.json`` in a temporary ``cache_dir``, not the working directory),
  ``query_Q`` = ``attribute`` against the first ``Q`` queries. dattri takes the query's loss from the
  model's own output (HF's mean over the batch's tokens): one positive scale for all queries of a
  batch, which no ranking sees.
* ``fim-proj``: the same with ``hessian="eFIM"``: LoGra's own preconditioner, the dense empirical
  Fisher of the projected gradients per layer (neither K-FAC nor EK-FAC; damping dattri's default).
* ``ekfac-full``: ``IFAttributorEKFAC`` (``torch.func`` per-example gradients of every tracked
  weight and bias, EK-FAC in full space); dattri's damping is one absolute number, set to 0.1 × the
  mean corrected eigenvalue over all layers (gradindex: 0.1 × the mean per layer).
"""

from __future__ import annotations

import tempfile

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main, conv1d_to_linear, summed_lm_loss  # noqa: E402


class Rows(Dataset):
    """Token-id rows as ``{"input_ids", "labels"}`` records: LoGra calls the model with them as keywords,
    and takes a query's loss from the model's own output (HF's mean over the batch's tokens)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def logra(hessian: str):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        from dattri.algorithm.logra import LoGraAttributor
        from dattri.task import AttributionTask

        tracked = conv1d_to_linear(w.model)

        def loss(model, batch, device):
            ids = batch["input_ids"].to(device)
            return summed_lm_loss(model(input_ids=ids).logits, ids).sum()

        train = DataLoader(Rows(w.train), batch_size=w.batch_size, shuffle=False)
        out = {}
        with tempfile.TemporaryDirectory(prefix="dattri-logra-") as cache:  # its batch_metadata.json (default: ".")
            with clock.phase("build"):
                task = AttributionTask(loss_func=loss, model=w.model, checkpoints=w.model.state_dict())
                attributor = LoGraAttributor(task=task, layer_names=tracked, hessian=hessian, device="cpu",
                                             proj_dim=256, offload="cpu", cache_dir=cache)
                attributor.cache(train)
            for q in queries:
                with clock.phase(f"query_{q}"):
                    test = DataLoader(Rows(w.queries[:q]), batch_size=w.batch_size, shuffle=False)
                    out[q] = attributor.attribute(train, test).T.double().numpy()  # [N, Q] → [Q, N]
        return out

    return run


def ekfac_full(w: Workload, queries: list[int], clock: Clock) -> dict:
    from dattri.algorithm.influence_function import IFAttributorEKFAC
    from dattri.task import AttributionTask

    tracked = conv1d_to_linear(w.model)
    model = w.model

    def target(params, batch):
        ids = batch[0]
        ids = ids.unsqueeze(0) if ids.ndim == 1 else ids
        logits = torch.func.functional_call(model, params, (ids,)).logits
        return summed_lm_loss(logits, ids).sum()

    train = DataLoader(TensorDataset(w.train), batch_size=w.batch_size, shuffle=False)
    out = {}
    with clock.phase("build"):
        task = AttributionTask(loss_func=target, model=model, checkpoints=model.state_dict())
        attributor = IFAttributorEKFAC(task=task, module_name=tracked, device="cpu")
        attributor.cache(train)
        lambdas = attributor.cached_lambdas.values()
        attributor.damping = 0.1 * float(torch.cat([v.flatten() for v in lambdas]).mean())
    for q in queries:
        with clock.phase(f"query_{q}"):
            test = DataLoader(TensorDataset(w.queries[:q]), batch_size=w.batch_size, shuffle=False)
            out[q] = attributor.attribute(train, test).T.double().numpy()
    return out


METHODS = {"graddot-proj": logra("Identity"), "fim-proj": logra("eFIM"), "ekfac-full": ekfac_full}

if __name__ == "__main__":
    raise SystemExit(adapter_main(METHODS, ("dattri",)))

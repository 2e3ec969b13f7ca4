"""TRAK (MadryLab, PyPI ``traker``) on the shared workload, through its public API.

``TRAKer`` with its ``FunctionalGradientComputer`` (``torch.func`` per-example gradients of the 16
block layers' weights and biases, ``grad_wrt``) and, on a CPU, its ``BasicProjector`` (Gaussian).
TRAK projects the whole gradient at once, not per layer, and its CPU projector either holds the
dense ``grad_dim × proj_dim`` matrix (one block) or draws it again for every batch (several
blocks): 256 numbers in all, in one block (a 3.2 GB matrix), is what fits here — 256 per layer
(4096) would need a 51 GB matrix. The model output is the sequence's summed next-token loss and
the out-to-loss weight is 1, so TRAK's score is ``φ_q (ΦᵀΦ)⁻¹ φ_i`` on projected gradients: a
projected GradDot preconditioned by the training features' Gram matrix. ``build``: ``featurize``
over the training batches, ``finalize_features`` (which frees the projection matrix that a one-block
``BasicProjector`` then lacks when scoring, so a second ``TRAKer`` is opened on the same save
directory, as TRAK's multi-process recipe does); ``query_Q``: ``score`` + ``finalize_scores``.
"""

from __future__ import annotations

import tempfile

import torch  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main, block_linears, summed_lm_loss  # noqa: E402

PROJ_DIM = 256


def trak_proj(w: Workload, queries: list[int], clock: Clock) -> dict:
    from trak import TRAKer
    from trak.modelout_functions import AbstractModelOutput
    from trak.projectors import BasicProjector, ProjectionType

    class SummedLoss(AbstractModelOutput):
        def __init__(self) -> None:
            super().__init__()

        @staticmethod
        def get_output(model, weights, buffers, input_ids):
            ids = input_ids.unsqueeze(0)
            logits = torch.func.functional_call(model, (weights, buffers), args=(ids,)).logits
            return summed_lm_loss(logits, ids).sum()

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            return torch.ones(len(batch[0]), 1)

    model = w.model
    grad_wrt = [f"{n}.{p}" for n in block_linears(model) for p in ("weight", "bias")]
    params = dict(model.named_parameters())
    grad_dim = sum(params[p].numel() for p in grad_wrt)
    N = len(w.train)
    out = {}
    with tempfile.TemporaryDirectory(prefix="trak-") as d:
        def open_traker() -> TRAKer:
            projector = BasicProjector(grad_dim=grad_dim, proj_dim=PROJ_DIM, seed=0, proj_type=ProjectionType.normal,
                                       device="cpu", block_size=PROJ_DIM, dtype=torch.float32)
            return TRAKer(model=model, task=SummedLoss(), train_set_size=N, save_dir=d, device="cpu",
                          projector=projector, use_half_precision=False, grad_wrt=grad_wrt)

        with clock.phase("build"):
            traker = open_traker()
            traker.load_checkpoint(model.state_dict(), model_id=0)
            for s in range(0, N, w.batch_size):
                ids = w.train[s:s + w.batch_size]
                traker.featurize(batch=(ids,), num_samples=len(ids))
            traker.finalize_features()  # frees the projection matrix, which score() then lacks (one block)
            del traker
            traker = open_traker()  # so a second TRAKer on the same save_dir scores, as TRAK's SLURM recipe does
        for q in queries:
            with clock.phase(f"query_{q}"):
                traker.start_scoring_checkpoint(exp_name=f"q{q}", checkpoint=model.state_dict(), model_id=0,
                                                num_targets=q)
                for s in range(0, q, w.batch_size):
                    ids = w.queries[s:min(q, s + w.batch_size)]
                    traker.score(batch=(ids,), num_samples=len(ids))
                out[q] = torch.as_tensor(traker.finalize_scores(exp_name=f"q{q}")).T.double().numpy()
    return out


METHODS = {"trak-proj": trak_proj}

if __name__ == "__main__":
    raise SystemExit(adapter_main(METHODS, ("traker",)))

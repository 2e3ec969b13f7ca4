"""Kronfluence (PyPI ``kronfluence``) on the shared workload, through its public API.

Kronfluence tracks ``nn.Linear``, so each block ``Conv1D`` becomes the equal ``nn.Linear`` (its
bias becomes Kronfluence's bias column, as in gradindex). Loss: next-token cross-entropy summed
per sequence, empirical Fisher (observed labels) — what gradindex fits. ``build``:
``Analyzer.fit_all_factors`` with ``FactorArguments(strategy=...)`` (``identity`` fits nothing:
full-gradient GradDot; ``kfac``; ``ekfac``: covariance, eigendecomposition, eigenvalue correction);
``query_Q``: ``Analyzer.compute_pairwise_scores`` for the first ``Q`` queries (Kronfluence
preconditions the queries and recomputes every training gradient per call: one pass over the
training set per call), damping ``None`` = 0.1 × the mean eigenvalue per module, as gradindex.
Everything is full space: Kronfluence does not project.
"""

from __future__ import annotations

import tempfile

import torch  # noqa: E402

from benchmarks.peers.common import Clock, Workload, adapter_main, conv1d_to_linear, summed_lm_loss  # noqa: E402


def method(strategy: str):
    def run(w: Workload, queries: list[int], clock: Clock) -> dict:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task

        tracked = conv1d_to_linear(w.model)

        class Rows(torch.utils.data.Dataset):
            def __init__(self, ids: torch.Tensor):
                self.ids = ids

            def __len__(self) -> int:
                return len(self.ids)

            def __getitem__(self, i: int) -> dict:
                return {"input_ids": self.ids[i]}

        class LM(Task):
            def compute_train_loss(self, batch, model, sample=False):
                ids = batch["input_ids"]
                logits = model(input_ids=ids).logits
                if sample:  # the true Fisher's sampled labels (not used: empirical Fisher)
                    with torch.no_grad():
                        probs = torch.softmax(logits[:, :-1].float(), -1)
                        ids = torch.cat([ids[:, :1], torch.multinomial(probs.flatten(0, 1), 1).view(
                            ids.shape[0], -1)], 1)
                return summed_lm_loss(logits, ids).sum()

            def compute_measurement(self, batch, model):
                return self.compute_train_loss(batch, model)

            def get_influence_tracked_modules(self):
                return tracked

        model = prepare_model(w.model.eval(), LM())
        out = {}
        with tempfile.TemporaryDirectory(prefix="kronfluence-") as d:
            an = Analyzer("peers", model, LM(), cpu=True, disable_tqdm=True, output_dir=d)
            fa = FactorArguments(strategy=strategy, use_empirical_fisher=True)
            with clock.phase("build"):
                an.fit_all_factors(strategy, Rows(w.train), per_device_batch_size=w.batch_size, factor_args=fa,
                                   overwrite_output_dir=True)
            sa = ScoreArguments(damping_factor=None)
            for q in queries:
                with clock.phase(f"query_{q}"):
                    an.compute_pairwise_scores(f"scores{q}", strategy, Rows(w.queries[:q]), Rows(w.train),
                                               per_device_query_batch_size=q,
                                               per_device_train_batch_size=w.batch_size, score_args=sa,
                                               overwrite_output_dir=True)
                    out[q] = an.load_pairwise_scores(f"scores{q}")["all_modules"].double().numpy()
        return out

    return run


METHODS = {"graddot-full": method("identity"), "kfac-full": method("kfac"), "ekfac-full": method("ekfac")}

if __name__ == "__main__":
    raise SystemExit(adapter_main(METHODS, ("kronfluence",)))

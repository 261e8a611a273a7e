"""Public Lightning routes only: the precision plugins, the model summary's FLOPs, the prediction writer, helpers.

(Single process, no collective. The distributed behaviour of clipping is in tests/test_strategy_eval.py,
tests/test_replicated_kv.py and tests/test_fabric.py.)
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

import lightning_tsp
from lightning_tsp import TSPConfigError, TSPLlama, get_config


def test_precision_plugins_are_public_subclasses():
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from lightning_tsp.strategy import TSPMixedPrecision, TSPPrecision, tsp_precision_plugin

    calls = []

    def clip(params, max_norm):
        calls.append((list(params), max_norm))

    plugin = tsp_precision_plugin(Precision(), clip)
    assert type(plugin) is TSPPrecision
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    optimizer = torch.optim.SGD([p], lr=0.1)
    plugin.clip_gradients(optimizer, 0.5, "norm")  # Lightning's own entry point
    assert len(calls) == 1 and calls[0][0][0] is p and calls[0][1] == 0.5
    plugin.clip_gradients(optimizer, 0.5, "value")  # value clipping stays Lightning's (elementwise: exact)
    assert len(calls) == 1 and torch.equal(p.grad, torch.full((3,), 0.5))
    assert type(tsp_precision_plugin(MixedPrecision("bf16-mixed", "cpu"), clip)) is TSPMixedPrecision

    class Custom(Precision):
        pass

    with pytest.raises(TSPConfigError, match="precision plugin Custom"):
        tsp_precision_plugin(Custom(), clip)


def _lm_with_tsp_model(cfg):
    from lightning.pytorch import LightningModule

    module = LightningModule()
    module.model = TSPLlama(cfg, device="meta")
    return module


def test_model_summary_reports_the_model_flops(caplog):
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import summarize

    from lightning_tsp.callbacks import TSPModelSummary, model_flops_per_batch

    cfg = get_config("tiny")
    module = _lm_with_tsp_model(cfg)
    assert summarize(module).total_flops == 0  # what Lightning's own summary reports for a TSP model
    b, s = 2, 64
    trainer = SimpleNamespace(datamodule=SimpleNamespace(batch_size=b, seq_len=s), is_global_zero=True)
    callback = TSPModelSummary()
    assert isinstance(callback, ModelSummary)
    with caplog.at_level(logging.INFO):
        callback.on_fit_start(trainer, module)
    forward = model_flops_per_batch(cfg, b, s)["model"] // 3  # one forward pass (Lightning's meaning)
    assert callback.total_flops == forward > 0
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    assert get_human_readable_count(forward) in caplog.text and "Total Flops" in caplog.text
    # explicit sizes win over the datamodule's
    explicit = TSPModelSummary(batch_size=1, seq_len=32)
    explicit.on_fit_start(trainer, module)
    assert explicit.total_flops == model_flops_per_batch(cfg, 1, 32)["model"] // 3


def test_language_model_installs_the_summary():
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    from lightning_tsp.callbacks import TSPModelSummary
    from lightning_tsp.module import TSPLanguageModel

    module = TSPLanguageModel()
    module._trainer = SimpleNamespace(callbacks=[ModelSummary()])  # Lightning's default summary
    assert [type(c) for c in module.configure_callbacks()] == [TSPModelSummary]
    module._trainer = SimpleNamespace(callbacks=[RichModelSummary()])  # the user's choice: left alone
    assert module.configure_callbacks() == []
    module._trainer = SimpleNamespace(callbacks=[])  # enable_model_summary=False
    assert module.configure_callbacks() == []


def test_sequence_score_writer_is_a_prediction_writer(tmp_path, capsys):
    from lightning.pytorch.callbacks import BasePredictionWriter

    from lightning_tsp.callbacks import SequenceScoreWriter

    writer = SequenceScoreWriter(str(tmp_path / "out"))
    assert isinstance(writer, BasePredictionWriter)
    trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={}), world_size=1, global_rank=0,
                              predict_loop=SimpleNamespace(current_batch_indices=[7, 3]))
    writer.on_predict_start(trainer, None)
    outputs = {"nll_sum": torch.tensor([2.0, 4.0], dtype=torch.float64), "tokens": torch.tensor([1.0, 2.0]),
               "perplexity": torch.tensor([7.389, 7.389])}
    writer.on_predict_batch_end(trainer, None, outputs, None, 0)  # Lightning's hook -> write_on_batch_end
    writer.on_predict_end(trainer, None)
    lines = [json.loads(x) for x in (tmp_path / "out" / "scores-dp0.jsonl").read_text().splitlines()]
    assert lines == [
        {"batch": 0, "index": 0, "nll_sum": 2.0, "tokens": 1.0, "perplexity": pytest.approx(7.389), "sample": 7},
        {"batch": 0, "index": 1, "nll_sum": 4.0, "tokens": 2.0, "perplexity": pytest.approx(7.389), "sample": 3},
    ]
    assert "perplexity 7.3891" in capsys.readouterr().out


def test_helpers_live_outside_the_strategy():
    from lightning_tsp import predict
    from lightning_tsp.models import find_tsp_model, named_tsp_models

    assert lightning_tsp.predict_logprobs is predict.predict_logprobs
    import lightning_tsp.strategy as strategy

    assert not any(hasattr(strategy, name) for name in ("find_tsp_model", "gather_sequence", "predict_logprobs"))
    cfg = get_config("tiny")
    outer = _lm_with_tsp_model(cfg)
    assert find_tsp_model(outer) is outer.model and find_tsp_model(outer.model) is outer.model
    assert [n for n, _ in named_tsp_models(outer)] == ["model"]
    assert find_tsp_model(torch.nn.Linear(2, 2), required=False) is None
    outer.other = TSPLlama(cfg, device="meta")
    with pytest.raises(TSPConfigError, match="found 2 .*'model', 'other'"):
        find_tsp_model(outer)


def test_no_stack_frames_or_instance_patches():
    import inspect

    import lightning_tsp.strategy as strategy

    source = inspect.getsource(strategy)
    assert "_getframe" not in source and "f_locals" not in source
    assert "_install_gradient_clipping" not in source and "plugin.clip_grad_by_norm =" not in source

"""The first-loss check warns loudly when the loss is far from ln(vocab), e.g. inflated x16 by an accumulation bug."""

import math
from types import SimpleNamespace

from flame.config import Config
from flame.train import Trainer


def first_loss_warning(capsys, loss: float) -> str:
    Trainer.sanity_check_first_loss(SimpleNamespace(cfg=Config()), loss)
    return capsys.readouterr().err


def test_warns_on_inflated_or_nan_first_loss(capsys):
    ln_v = math.log(Config().model.vocab_size)
    assert first_loss_warning(capsys, ln_v * 1.02) == ""
    assert "FIRST LOSS" in first_loss_warning(capsys, ln_v * 16)
    assert "global target-token count" in first_loss_warning(capsys, ln_v * 16)
    assert "FIRST LOSS" in first_loss_warning(capsys, ln_v * 0.5)
    assert "FIRST LOSS" in first_loss_warning(capsys, math.nan)

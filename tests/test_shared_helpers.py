"""The helpers every command shares: the synchronising clock, comma-separated integer options and the number
format of generated tables."""

from __future__ import annotations

import argparse

import pytest
import torch

from infinikv.cliargs import int_list
from infinikv.clock import now
from infinikv.reporting import MISSING, fmt


def test_clock_synchronises_only_a_cuda_device(monkeypatch):
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronised.append)
    first = now(torch.device("cpu"))
    assert synchronised == [] and now(torch.device("cpu")) >= first
    cuda = torch.device("cuda", 0)
    assert now(cuda) >= first and synchronised == [cuda]


@pytest.mark.parametrize(("text", "values"), [("8", (8,)), ("8,16", (8, 16)), (" 8, 16 ,", (8, 16))])
def test_int_list_reads_positive_integers(text, values):
    assert int_list(text) == values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8,x", "expected comma-separated integers, got '8,x'"),
        ("", "expected comma-separated integers, got ''"),
        (" , ", "expected comma-separated integers, got ' , '"),
        ("0,8", "values must be positive, got '0,8'"),
        ("-4", "values must be positive, got '-4'"),
    ],
)
def test_int_list_rejects_in_one_line(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        int_list(text)
    assert str(raised.value) == message


def test_int_list_as_an_argparse_type(capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--batch", type=int_list, default=(1,))
    assert parser.parse_args(["--batch", "2,4"]).batch == (2, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--batch", "2,x"])
    assert "argument --batch: expected comma-separated integers, got '2,x'" in capsys.readouterr().err


def test_fmt_digits_scale_and_missing():
    assert fmt(1.2345) == "1.23" and fmt(1.2345, 1) == "1.2" and fmt(3, 0) == "3"
    assert fmt(0.0123, 1, scale=1e3) == "12.3" and fmt(0.256, 0, scale=100) == "26"
    assert fmt(None) == fmt(None, 3, scale=1e3) == MISSING == "–"

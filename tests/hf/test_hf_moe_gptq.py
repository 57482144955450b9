"""`torch-marlin convert --method gptq` on tiny Mixtral, Qwen3-MoE and gpt-oss models built from
configs: the expert stacks get GPTQ per expert on the tokens the model routes to them, the
summary shows each expert's error, the checkpoint loads silently, and its logits match the
float model holding the dequantized weights."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from hf_helpers import read_config
from test_hf_gptq import TEXTS, tiny_tokenizer, write_jsonl
from test_hf_moe import (assert_stacks_round_to_nearest, check_against_reference, experts_of, moe_dir,  # noqa: F401
                         reference_with_dequantized_weights)
from test_hf_quiet_loading import expect_silence
from torch_marlin.cli import main as cli_main
from torch_marlin.hf import from_pretrained


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_cli_gptq_calibrates_expert_stacks(arch, moe_dir, tmp_path, capfd):  # noqa: F811
    src, dst = str(tmp_path / "src"), str(tmp_path / "q")
    shutil.copytree(moe_dir(arch), src)
    tiny_tokenizer(src)
    data = write_jsonl(tmp_path / "cal.jsonl", TEXTS * 3)
    assert cli_main(["convert", src, dst, "--method", "gptq", "--calibration", data, "--calibration-samples", "24",
                     "--calibration-length", "16", "--group-size", "32", "--format", "int4"]) == 0
    out = capfd.readouterr().out
    assert "and 4 expert stacks (GPTQ per expert) quantized" in out, out
    stacks = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    for stack in stacks:
        assert f"  {stack} (round to nearest " in out, out
    assert " n=" in out and "->" in out
    qc = read_config(dst)["quantization_config"]
    assert qc["source"]["experts_quantizer"] == "gptq"
    assert sorted(n for n, e in qc["modules"].items() if e.get("layout") == "experts") == sorted(stacks)

    with expect_silence(capfd):
        model = from_pretrained(dst)
    assert sorted(experts_of(model)) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    check_against_reference(model, reference_with_dequantized_weights(src, model))
    with expect_silence(capfd):
        auto = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, model(ids).logits)
    # Not round to nearest: at least one stack differs from it.
    with pytest.raises(AssertionError):
        assert_stacks_round_to_nearest(model, src, 32, "mse")


def test_cli_act_order_on_moe_is_refused_clearly(moe_dir, tmp_path, capsys):  # noqa: F811
    src, dst = str(tmp_path / "src"), tmp_path / "q"
    shutil.copytree(moe_dir("qwen3_moe"), src)
    tiny_tokenizer(src)
    data = write_jsonl(tmp_path / "cal.jsonl", TEXTS)
    assert cli_main(["convert", src, str(dst), "--method", "gptq", "--calibration", data, "--act-order",
                     "--group-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "act_order=True cannot be used for expert stacks" in err, err
    assert not dst.exists()

"""What frameworks do to a sharded model: DDP wrapping, ``state_dict()``, ``save_pretrained``, PEFT, optimizers.

Each misuse that used to corrupt a model silently is either correct now or a clear error,
checked by its message.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

import shardline
from shardline.engine import use_collectives
from shardline.errors import ShardingError
from shardline.testing import FaultyCollectives, GradientFault, run_distributed
from tests.models import (
    BATCH,
    SEQ,
    Block,
    ParityModel,
    batch,
    chain_terms,
    grad_errors,
    local_slice,
    loss_fn,
    parity_forward_terms,
)
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectories,
    assert_trajectory,
    injecting,
    trajectory_ratio,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


# ---------------------------------------------------------------------- DistributedDataParallel
class _Parent(nn.Module):
    """What Lightning's ddp strategy wraps: an unsharded module holding the sharded model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _ddp(rank: int, world_size: int) -> dict:
    """DDP refused over shards; DDP over the unsharded rest of a model whose blocks are sharded trains right."""
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block))
    before = {k: v.clone() for k, v in shardline.full_state_dict(model).items()}
    # Every parameter sharded: DDP has nothing to do and must not touch the shards.
    with pytest.raises(ShardingError, match=r"DistributedDataParallel was asked to wrap a ParityModel sharded"):
        DistributedDataParallel(model)
    after = shardline.full_state_dict(model)
    untouched = all(torch.equal(before[k], after[k]) for k in before)

    # DDP around an unsharded parent cannot be intercepted at construction. (With uneven shards DDP's own
    # shape check fails there, on the ranks whose shapes differ.) With even shards the first forward refuses.
    even = shardline.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), shardline.layer_policy(nn.Linear))
    wrapped = DistributedDataParallel(_Parent(even))
    with pytest.raises(ShardingError, match=r"runs inside torch DistributedDataParallel, which manages 4 of"):
        wrapped(torch.zeros(2, 8))

    # Blocks sharded, the root's own parameters left to DDP (told what to ignore): one correct result.
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    hybrid = ParityModel()
    for block in hybrid.blocks:
        shardline.fully_shard(block)
    ignored = shardline.engine.ddp_ignored_names(hybrid)
    hybrid._ddp_params_and_buffers_to_ignore = ignored
    ddp = DistributedDataParallel(hybrid)
    managed = {n for n, p in hybrid.named_parameters() if any(p is q for q in ddp._module_parameters)}
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step)
        loss_fn(reference(tokens), targets).backward()
        loss_fn(ddp(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            grad_err = grad_errors(hybrid, reference)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    got = shardline.full_state_dict(hybrid)
    expected = reference.state_dict()
    # The same check must see a broken gradient reduction in the sharded blocks.
    caught = {}
    tokens, targets = batch(0)
    for fault in GradientFault:
        torch.manual_seed(0)
        fresh = ParityModel()
        torch.manual_seed(0)
        broken = ParityModel()
        for block in broken.blocks:
            shardline.fully_shard(block)
        broken._ddp_params_and_buffers_to_ignore = shardline.engine.ddp_ignored_names(broken)
        with use_collectives(broken, FaultyCollectives(fault)):
            loss_fn(
                DistributedDataParallel(broken)(local_slice(tokens, rank, world_size)),
                local_slice(targets, rank, world_size),
            ).backward()
        loss_fn(fresh(tokens), targets).backward()
        caught[fault.value] = {k: v for k, v in grad_errors(broken, fresh).items() if k.startswith("blocks.")}
    return {
        "untouched": untouched,
        "ignored_by_block": sorted(ignored),
        "ddp_manages": sorted(managed),
        "grad_err": grad_err,
        "ratio": trajectory_ratio(got, expected),
        "caught": caught,
    }


@pytest.mark.numerics
def test_distributed_data_parallel_ignores_shards_or_refuses() -> None:
    res = run_distributed(_ddp, 2)[0]
    assert res["untouched"], "a refused DDP must not have broadcast anything over the shards"
    assert "blocks.0.fc1.weight" in res["ignored_by_block"]
    assert "blocks.1.frozen_bias" in res["ignored_by_block"]
    assert not any(name.startswith(("emb.", "norm.", "head.")) for name in res["ignored_by_block"])
    assert res["ddp_manages"] == ["emb.weight", "norm.bias", "norm.weight"], res["ddp_manages"]
    where = "DDP over the unsharded rest plus shardline blocks"
    rule = Reorder(chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=2))
    assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients")
    assert_trajectory(res["ratio"], f"{where}: parameters after 3 AdamW steps")
    for fault, errs in res["caught"].items():
        assert_caught(errs, rule, f"{where} with {fault}")


# ---------------------------------------------------------------------- state_dict()
def _state_dicts(rank: int, world_size: int) -> dict:
    out = {}
    for strategy in ("full_shard", "no_shard"):
        torch.manual_seed(0)
        expected = ParityModel().state_dict()
        torch.manual_seed(0)
        model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy)
        assert not any(isinstance(p, DTensor) for p in model.parameters()), "parameters stay plain tensors"
        sd = model.state_dict()
        assert list(sd) == list(expected)
        want = Shard(0) if strategy == "full_shard" and world_size > 1 else Replicate()
        for key, value in sd.items():
            if key == "pos_scale":
                assert not isinstance(value, DTensor)
                continue
            assert isinstance(value, DTensor), key
            assert value.placements == (want,), (key, value.placements)
            assert tuple(value.shape) == tuple(expected[key].shape), key
            assert torch.equal(value.full_tensor(), expected[key]), key
        # No copy: the pieces live in the flat shard buffers.
        pieces = {value.to_local().untyped_storage().data_ptr() for k, value in sd.items() if k != "pos_scale"}
        flat = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert pieces <= flat, "state_dict() pieces must share the shards' memory"

        # DTensor-aware tools see whole tensors.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(full[k], expected[k]) for k in expected)

        # load_state_dict takes full tensors, DTensors, and torch's own full-state-dict loader works.
        scrambled = {k: torch.randn_like(v) for k, v in expected.items()}
        model.load_state_dict(scrambled)
        assert torch.equal(shardline.full_state_dict(model)["blocks.1.fc2.weight"], scrambled["blocks.1.fc2.weight"])
        model.load_state_dict(sd)  # DTensors that alias the shards themselves
        torch.manual_seed(1)
        other = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy)
        other.load_state_dict(model.state_dict())  # DTensors of another model with the same layout
        set_model_state_dict(
            model, expected, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        )
        back = shardline.full_state_dict(model)
        out[strategy] = all(torch.equal(back[k], expected[k]) for k in expected)
        with pytest.raises(RuntimeError, match=r"size mismatch for blocks.0.fc1.weight: the state dict has shape"):
            model.load_state_dict({**expected, "blocks.0.fc1.weight": torch.zeros(3, 3)})
        with pytest.raises(ShardingError, match=r"load_state_dict\(assign=True\) would replace the shards"):
            model.load_state_dict(expected, assign=True)
    return out


def test_state_dict_gives_dtensors_and_loads_them_back() -> None:
    res = run_distributed(_state_dicts, 2)[0]
    assert res == {"full_shard": True, "no_shard": True}


# ---------------------------------------------------------------------- optimizers
def _optimizer_before_sharding(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = ParityModel()
    stale = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before sharding: holds the originals
    shardline.wrap(model, shardline.layer_policy(Block))
    loss_fn(model(torch.zeros(2, 3, dtype=torch.long)), torch.zeros(2, 3, dtype=torch.long)).backward()
    with pytest.raises(ShardingError, match=r"AdamW holds 19 parameter\(s\) that fully_shard replaced by shards"):
        stale.step()
    good = torch.optim.AdamW(model.parameters(), lr=1e-2)
    good.step()  # built after sharding: fine
    # Parameters taken while gathered are copies whose updates would be lost.
    model.blocks[0].unshard()
    gathered = torch.optim.SGD(model.blocks[0].parameters(), lr=0.1)
    model.blocks[0].reshard()
    with pytest.raises(ShardingError, match=r"holds \d+ gathered \(full\) parameter\(s\)"):
        gathered.step()


def test_an_optimizer_built_before_sharding_is_refused_at_its_first_step() -> None:
    run_distributed(_optimizer_before_sharding, 2)


# ---------------------------------------------------------------------- Hugging Face and PEFT
def _tiny_llama(dtype: torch.dtype) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _peft_model(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    base = _tiny_llama(dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)  # bf16 base: adapters are cast to fp32 (autocast_adapter_dtype)
    with torch.no_grad():  # non-zero B so both adapter matrices train from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return model


def _llama_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(900 + step))


def _llama_forward_terms(config: transformers.LlamaConfig, seq: int, lora_rank: int) -> int:
    """Longest chain of reductions in one forward of a Llama with LoRA on q/v (see ``tests.numerics``).

    Per layer: RMSNorm over the hidden size; q/k/v over it, plus the adapter's rank; attention
    scores over the head dim, the softmax and the weighted sum over the sequence; o_proj over the
    hidden size; RMSNorm; gate/up over the hidden size; down over the intermediate size. Then
    the final RMSNorm, the head over the hidden size and the softmax over the vocabulary.
    """
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    layer = hidden + (hidden + lora_rank) + head_dim + 2 * seq + hidden + hidden + hidden + config.intermediate_size
    return config.num_hidden_layers * layer + hidden + hidden + config.vocab_size


def _peft(rank: int, world_size: int, dtype: torch.dtype, tmp: str, fault: str | None = None) -> dict:
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    reference = _peft_model(0, dtype)
    model = shardline.wrap(_peft_model(0, dtype), shardline.layer_policy(layer), strategy="full_shard")
    mixed = [u for u in shardline.engine.subtree_units(model) if len(u.dtypes) > 1]
    trainable = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(trainable, lr=0.5, momentum=0.9)
    losses, ref_losses, grad_bytes = [], [], []
    for step in range(3):
        tokens = _llama_batch(step)
        total = 0.0
        for r in range(world_size):  # per-rank slices, unscaled, then averaged (see tests/test_finetune.py)
            part = local_slice(tokens, r, world_size)
            ref_loss = reference(input_ids=part, labels=part).loss
            ref_loss.backward()
            total += ref_loss.item() / world_size
        for p in trainable:
            p.grad /= world_size
        ref_losses.append(total)
        mine = local_slice(tokens, rank, world_size)
        broken = injecting(model, fault)
        with shardline.count_collectives(model) as counter, broken:
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
        grad_bytes.append(counter.nbytes("reduce_scatter"))
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            grad_err = grad_errors(model, reference)
            if fault:
                return {"grad_err": grad_err}
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    adapters = [k for k in expected if "lora_" in k]
    with pytest.raises(
        ShardingError, match=r"save_pretrained on a .* needs the full weights.*shardline.full_state_dict"
    ):
        model.save_pretrained(tmp)
    state = shardline.full_state_dict(model, rank0_only=True)
    model.save_pretrained(tmp, state_dict=state, is_main_process=rank == 0)
    dist.barrier()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_err": grad_err,
        "adapter_ratio": trajectory_ratio(full, expected, skip=[k for k in expected if k not in adapters]),
        "caught": {f.value: _peft(rank, world_size, dtype, tmp, f.value)["grad_err"] for f in GradientFault},
        "terms": _llama_forward_terms(reference.config, _llama_batch(0).shape[1], 4),
        "base_equal": all(torch.equal(full[k], expected[k]) for k in expected if "lora_" not in k),
        "mixed_units": len(mixed),
        "grad_bytes": grad_bytes,
        "expected_grad_bytes": sum(
            world_size * math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * p.element_size()
            for p in trainable
        ),
        "adapter_dtypes": sorted({str(p.dtype) for p in trainable}),
    }


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-base"])
def test_peft_lora_on_a_tiny_llama_matches_one_process(dtype: torch.dtype, tmp_path: Path) -> None:
    res = run_distributed(_peft, 2, args=(dtype, str(tmp_path / "adapter")), timeout=110)[1]
    # The reference backpropagates each rank's slice as that rank does: a bf16 base rounds alike on
    # both sides, and the adapters' fp32 chain bounds the rest.
    rule = Reorder(chain_terms(forward=res["terms"], tokens=_llama_batch(0).numel(), world_size=2))
    assert_reordered(res["grad_err"], rule, "LoRA adapters: first step's gradients")
    assert_trajectories(res["losses"], res["ref_losses"], "LoRA on a tiny Llama")
    assert_trajectory(res["adapter_ratio"], "LoRA adapters after 3 SGD steps")
    for fault, errs in res["caught"].items():
        assert_caught(errs, rule, f"LoRA adapters with {fault}")
    assert res["base_equal"], "the frozen base must not change"
    assert res["adapter_dtypes"] == ["torch.float32"]
    if dtype == torch.bfloat16:
        assert res["mixed_units"] == 2, "each decoder layer holds a bf16 base and fp32 adapters"
    # Only the adapters' gradients travel: nothing for the frozen base.
    assert res["grad_bytes"] == [res["expected_grad_bytes"]] * 3
    # save_pretrained with the gathered weights writes what PEFT loads back.
    loaded = peft.PeftModel.from_pretrained(_tiny_llama(dtype), str(tmp_path / "adapter"))
    assert any("lora_A" in k for k in loaded.state_dict())


def _save_pretrained(rank: int, world_size: int, out: str) -> None:
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    torch.manual_seed(0)
    model = shardline.wrap(_tiny_llama(torch.float32), shardline.layer_policy(layer))
    with pytest.raises(ShardingError, match=r"save_pretrained on a LlamaForCausalLM sharded by shardline needs"):
        model.save_pretrained(out)
    full = shardline.full_state_dict(model, rank0_only=True)
    model.save_pretrained(out, state_dict=full, is_main_process=rank == 0)
    assert type(model).__name__ == "ShardedLlamaForCausalLM", "the class is restored after saving"
    dist.barrier()


def test_save_pretrained_with_the_gathered_weights_writes_a_loadable_model(tmp_path: Path) -> None:
    run_distributed(_save_pretrained, 2, args=(str(tmp_path / "out"),))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], "config.json names the user's class"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.manual_seed(0)
    expected = _tiny_llama(torch.float32).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)

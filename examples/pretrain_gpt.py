"""Pretrain a GPT model with megatron.training, as Megatron-LM's pretrain_gpt.py does.

Takes Megatron's usual flags and runs under torchrun. With --auto-parallel it runs exactly as
Megatron-LM's own script would, and the hook does the rest (CPU rehearsal without a GPU, the
prebuilt dataset helpers). Without it, the script does those two itself, so the same script
(and the same parallel layout) can be rehearsed on CPU with gloo before it is run on GPUs.
"""

import os
import sys
from functools import partial

# Run from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_pipette.integration.dropin import use_prebuilt_dataset_helpers  # noqa: E402
from megatron_pipette.integration.options import requested as auto_parallel_requested  # noqa: E402
from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal, rehearsal_requested  # noqa: E402

AS_MEGATRON_LM = auto_parallel_requested(sys.argv)
"""Under --auto-parallel the hook sets up what this script otherwise does itself."""

# No GPU (or PIPETTE_CPU_REHEARSAL=1): rehearse on CPU, see docs/cpu-rehearsal.md.
if rehearsal_requested() and not AS_MEGATRON_LM:
    enable_cpu_rehearsal()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.extensions.transformer_engine import HAVE_TE  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402
from megatron.training import get_args, get_timers, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split, print_rank_0  # noqa: E402


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build one GPT model chunk; the local layer spec stands in when Transformer Engine is absent."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine" and HAVE_TE
    if args.num_experts:
        # MoE layers where --moe-layer-freq puts them, as Megatron-LM's pretrain_gpt.py builds them
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization, vp_stage=vp_stage
        )
    elif use_te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention,
            normalization=args.normalization,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _is_first_or_last_stage(vp_stage) -> bool:
    """Whether this model chunk holds the embedding or the loss, and so reads data."""
    return parallel_state.is_pipeline_first_stage(
        ignore_virtual=False, vp_stage=vp_stage
    ) or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    """Read the next micro-batch; only the first and last pipeline stages consume data.

    Every tensor-parallel rank reads its own copy (the datasets are deterministic and the
    sampler is data-parallel-ranked), which saves the broadcast from TP rank 0.
    """
    if not _is_first_or_last_stage(vp_stage):
        return None, None, None, None, None
    batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items() if v is not None}
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses plus the token count; Megatron averages over the global batch."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    """One forward pass; returns the output and the loss closure the schedule calls."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """Translate Megatron's data flags into megatron.core's dataset config."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train/valid/test datasets; --mock-data gives synthetic tokens."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(_is_first_or_last_stage, vp_stage),
        core_gpt_dataset_config_from_args(args),
    ).build()


# Every rank that needs data builds its own datasets (no TP-rank-0 broadcast).
train_valid_test_datasets_provider.is_distributed = True


def main() -> None:
    """Parse Megatron's flags and train."""
    if not AS_MEGATRON_LM:
        # The wheel's dataset helpers are prebuilt; initialize_megatron's `make` would fail on rank 0.
        use_prebuilt_dataset_helpers()
    # Flags of extensions (e.g. pipette's --auto-parallel) come in through extra_args_provider.
    args = parse_and_validate_args(extra_args_provider=None)
    pretrain(
        pretrain_cfg_container_from_args(args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )


if __name__ == "__main__":
    main()

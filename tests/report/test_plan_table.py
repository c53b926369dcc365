"""The plan table's legend: made from the same parts as the labels, so it cannot drift from them."""

from megatron_pipette.spec.layout import ABBREVIATIONS, Layout, legend

EVERYTHING = [
    Layout(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2,
           expert_tensor_parallel_size=1, pipeline_model_parallel_size=4, data_parallel_size=2, micro_batch_size=1,
           num_layers_per_virtual_pipeline_stage=2, decoder_first_pipeline_num_layers=5,
           decoder_last_pipeline_num_layers=5, account_for_embedding_in_pipeline_split=True,
           account_for_loss_in_pipeline_split=True, sequence_parallel=True, tp_comm_overlap=True,
           overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, use_distributed_optimizer=True,
           overlap_param_gather=True, overlap_param_gather_with_optimizer_step=True,
           recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
           use_megatron_fsdp=True),
    Layout(pipeline_model_parallel_size=2, data_parallel_size=1, micro_batch_size=1,
           pipeline_model_parallel_layout="Et|tL", recompute_granularity="selective", recompute_modules=("mlp",)),
    Layout(data_parallel_size=8, micro_batch_size=1, cpu_offloading_num_layers=4),
]


def test_every_part_of_a_label_is_in_the_legend_and_every_entry_is_a_part():
    used = [key for layout in EVERYTHING for key in layout.abbreviations()]
    assert set(used) == set(ABBREVIATIONS)
    for layout in EVERYTHING:     # each part of the label starts with the abbreviation the legend explains
        label, keys = layout.describe(), layout.abbreviations()
        assert all(key in label for key in keys), (label, keys)


def test_the_legend_names_only_what_its_layouts_use():
    line = legend([Layout(data_parallel_size=8, micro_batch_size=4, use_distributed_optimizer=True,
                          overlap_param_gather=True)])
    assert line == ("Abbreviations: tp --tensor-model-parallel-size; pp --pipeline-model-parallel-size; "
                    "dp data-parallel size (GPUs / (TP x CP x PP)); mbs --micro-batch-size; "
                    "dopt --use-distributed-optimizer; +opg --overlap-param-gather.")

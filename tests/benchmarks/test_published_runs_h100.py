"""benchmarks/validation/published_runs_h100.py reads each row's recipe as the run used it."""

import json
from types import SimpleNamespace

from benchmarks.validation import published_runs_h100 as runs

ROWS = {row["id"]: row for row in json.loads(runs.DATA.read_text())["rows"]}


def test_the_recipes_quick_geglu_replaces_the_sets_swiglu():
    """Megatron refuses --swiglu with --quick-geglu; the set wrote --swiglu for GPT-OSS's activation."""
    assert runs.with_recipe(["--swiglu", "--num-layers", "2"], ["--quick-geglu"]) == ["--num-layers", "2",
                                                                                       "--quick-geglu"]
    assert runs.with_recipe(["--swiglu"], ["--bf16"]) == ["--swiglu", "--bf16"]


def test_settings_that_need_another_are_priced_whatever_their_order():
    """GPT-OSS's router and attention settings price only once its --quick-geglu (listed after them)
    has replaced the SwiGLU with biases megatron-core cannot run."""
    flags, left = runs.recipe_flags(ROWS["mb25.11-gptoss"])
    assert left == []
    assert flags.index("--quick-geglu") > flags.index("--grad-reduce-in-bf16")
    assert {"--window-size", "--softmax-type", "--moe-router-force-load-balancing"} <= set(flags)


def test_the_recipes_provider_settings_are_priced():
    """GPT-OSS's provider clamps its activation (Megatron-Bridge's gpt_oss_bridge.py); the set's row
    leaves it out, the benchmark adds it, and the model it builds has it."""
    row = ROWS["mb25.11-gptoss"]
    assert row["recipe"]["function"] in runs.PROVIDER_FLAGS
    assert "--activation-func-clamp-value" not in row["model_flags"] + row["recipe"]["megatron_flags"]
    priced = runs.build(runs.model_argv(row, recipe=True) + runs.layout_argv(row["published_layout"]))
    assert priced.workload.activation_func_clamp_value == 7.0
    assert priced.workload.position_embedding_type == "yarn" and priced.workload.rotary_scaling_factor == 32.0
    assert runs.build(runs.base_argv(ROWS["mb26.04-qwen3-30b"])).workload.activation_func_clamp_value is None


def test_the_recipes_mtp_layer_is_priced_where_its_layout_puts_it():
    """DeepSeek-V3's recipe sets --mtp-num-layers 1 and spells its layer (m) in its layout; the row's
    layout, written without it, would not resolve with it (Megatron counts the m)."""
    row = ROWS["mb25.09-deepseekv3"]
    flags, _ = runs.recipe_flags(row)
    assert flags[flags.index("--mtp-num-layers") + 1] == "1"
    assert "m" not in row["published_layout"]["pipeline_model_parallel_layout"]
    assert runs.recipe_layout(row)["pipeline_model_parallel_layout"].endswith("mL")
    assert "error_message" not in runs.pinned(row, recipe=True)


def test_a_claimed_gain_over_ten_percent_names_the_terms_it_comes_from():
    published = {"predicted_s": 12.0, "breakdown_s": {"compute_s": 6.0, "ep_comm_s": 5.0, "pp_comm_s": 1.0}}
    found = {"search_s": 9.0, "search_gain": 12.0 / 9.0 - 1,
             "search_breakdown_s": {"compute_s": 5.9, "ep_comm_s": 2.0, "pp_comm_s": 1.1}}
    assert runs.gain_terms(published, found) == [("ep_comm_s", 3.0)]   # compute's 0.1 s is under 5% of the gap
    assert runs.describe_gain(runs.gain_terms(published, found)) == "ep_comm -3.00 s"
    small = {**found, "search_s": 11.0, "search_gain": 12.0 / 11.0 - 1}
    assert runs.gain_terms(published, small) == []                      # +9.1%: under the 10% that names terms


def test_the_search_keeps_the_recipes_layout_settings_and_frees_the_sizes():
    """Qwen3-235B's recipe overlaps the expert-parallel exchanges (and delays the experts' weight
    gradients); its published layout is priced with them, so the free search keeps them wherever
    Megatron accepts them (preferred), keeps the distributed optimizer, its overlaps and sequence
    parallelism (constraints), and chooses the sizes, micro-batch, interleaving and split itself."""
    priced = runs.build(runs.launch_argv(ROWS["mb25.09-qwen3-235b"], recipe=True))
    constraints, preferred = runs.search_settings(priced.fields)
    assert preferred == {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    assert constraints == {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                           "overlap_param_gather": True, "sequence_parallel": True}
    assert {"tensor_model_parallel_size", "expert_model_parallel_size", "micro_batch_size",
            "num_layers_per_virtual_pipeline_stage", "account_for_embedding_in_pipeline_split"} <= set(priced.fields)


def _pick(seconds: float, headroom: float) -> SimpleNamespace:
    """What plan returns, as far as the search reads it: the best candidate's time, layout and memory."""
    capacity = 80 * 2**30
    return SimpleNamespace(best=SimpleNamespace(
        time=SimpleNamespace(iteration_time_s=seconds,
                             breakdown=SimpleNamespace(as_dict=lambda: {"compute_s": seconds})),
        layout=SimpleNamespace(megatron_args=lambda: ["--micro-batch-size", "1"]),
        memory=SimpleNamespace(peak_bytes=round((1 - headroom) * capacity), headroom=headroom)))


def test_the_searchs_pick_keeps_its_memory_and_tight_picks_are_counted(monkeypatch):
    """A pick within the memory model's own error of the capacity (Qwen3-30B 26.04's micro-batch 2:
    78.0 of 79.2 GiB) claims a gain over a layout known to fit: the result keeps each pick's peak and
    headroom, and the summary counts the MoE picks under 2%."""
    monkeypatch.setattr(runs, "plan", lambda *args, **kwargs: _pick(8.0, headroom=0.015))
    runs.search.cache_clear()
    found = runs.searched(ROWS["mb26.04-qwen3-30b"], 10.0)
    runs.search.cache_clear()
    assert found["search_headroom"] == 0.015 and round(found["search_peak_gib"], 2) == 78.8
    rows = [{"moe": True, "recipe": {"error": 0.0, "fits": True, "headroom": 0.3}, "search": found},
            {"moe": True, "recipe": {"error": 0.0, "fits": True, "headroom": 0.3},
             "search": {**found, "search_headroom": 0.05}}]
    assert runs.summary(rows, "recipe")["moe_search_picks_within_2pct"] == 1


def test_the_search_runs_once_per_distinct_launch(monkeypatch):
    """Rows that differ only in their measured figure (releases of one recipe) share one search; the
    gain is each row's own."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return _pick(10.0, headroom=0.3)

    monkeypatch.setattr(runs, "plan", counted)
    runs.search.cache_clear()
    row = ROWS["mb26.04-qwen3-30b"]
    first = runs.searched(row, 12.0)
    second = runs.searched({**row, "id": "another release", "iteration_time_s": 1.0}, 11.0)
    runs.search.cache_clear()
    assert len(calls) == 1
    assert (first["search_gain"], second["search_gain"]) == (12.0 / 10.0 - 1, 11.0 / 10.0 - 1)


def test_the_search_also_tries_the_recipes_own_split_and_recomputation():
    """DeepSeek-V3's layout string (MTP layer on the last stage) and its recomputed modules are none of
    the search's own splits and recomputations: it tries them too, at the PP and VP they are written
    for, so the published layout is a candidate; a launch that sets neither adds no second search."""
    priced = runs.build(runs.launch_argv(ROWS["mb25.09-deepseekv3"], recipe=True))
    split = runs.recipe_split(priced.fields)
    assert split["pipeline_model_parallel_layout"].endswith("mL") and split["pipeline_model_parallel_size"] == 8
    assert tuple(split["recompute_modules"]) == ("mla_up_proj", "mlp")
    assert "expert_model_parallel_size" not in split and "micro_batch_size" not in split
    assert runs.recipe_split(runs.build(runs.launch_argv(ROWS["mb26.04-qwen3-30b"], recipe=True)).fields) is None

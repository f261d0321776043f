"""Shared fixtures, and the one list of slow tests.

`python -m pytest` runs the fast suite: pyproject.toml's addopts deselect `slow`. CI
(.ci/run) and `python -m pytest -m ""` run everything; `-m slow` only the slow part.
Helpers the tests import live in tests/helpers.py and in the app (see there).

Slow means one of:
  * end to end through real Flower processes (SuperLink, SuperNodes, `flwr run`):
    each costs from ~20 s to minutes of start-up, polling and teardown;
  * a federation long enough to show an effect (an attack's damage, a privacy budget
    running out, an asynchronous speedup) rather than that the path works;
  * a federation beyond the default run's one short federation per strategy family
    (FedAvg, robust, FedBuff, central DP, local DP, compression, ledger): resumes, waits,
    recoveries and attacks at length stay in CI, so the default run takes under 2 minutes
    on 2 idle cores; every module is still exercised by default.

The marks are set here, by module or by test / fixture name, never in the test files,
so the split is in one place; collection fails if a listed module, test or fixture is
gone (a renamed test must not silently become fast or stay slow by accident).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from app.simulation.local_grid import act_as_server

act_as_server()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per xdist worker, in this process and in the Flower processes it starts:
    # two workers with a thread per core each on a 2-core machine spin against each other in
    # OpenMP (tests/test_attacks.py's inflated-count federation: 964 s in such a CI run, 72 s alone).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent

# Whole modules: every test in them starts real Flower processes or subprocesses.
SLOW_MODULES: dict[str, str] = {
    "test_flwr_cli": "`flwr run` through the local simulation SuperLink",
    "test_superlink_loopback": "a SuperLink, SuperNodes and the flwr CLI on loopback (deployment path)",
    "test_gpu_smoke": "scripts/gpu_smoke.py --quick --device cpu in a subprocess (~30 s)",
    "test_gpu_check": "bench/gpu_check.py --quick --device cpu, and a ClientApp process it starts (~25 s)",
    "test_scale": "two federations of 100 and 1000 nodes, each in its own process",
    "test_soak": "the shortened soak: a supervised secure stack through node, ServerApp and SuperLink kills (~5 min)",
    "test_secagg_e2e": "secagg=plus through `flwr run` (10 nodes) and on the secure loopback stack with a killed node",
    "test_regions_deployment": "the two-level loopback deployment: 2 regions x 2 sites, 3 rounds, a site killed (~15 min)",
}

# Modules that mix fast and slow tests: the slow ones, by test function name (every
# parametrization of it) or by the name of a fixture defined in that module (every test
# that uses it).
SLOW_TESTS: dict[str, set[str]] = {
    "test_secagg": {"test_what_the_server_holds_of_one_node_is_uniform_over_many_rounds"},  # 400 SecAgg+ rounds
    # six federations, one per privacy mode
    "test_clear_figures": {"test_no_exact_figure_reaches_rows_prometheus_the_channel_or_the_live_page"},
    "test_bulyan": {"test_strategy_bulyan_runs_synchronously_and_keeps_n_minus_2f"},  # a 7-node federation
    "test_regions": {"test_a_resumed_run_keeps_each_aggregators_wan_residual"},  # three federations
    # two federations, secure and in the clear (the default run keeps the secure combine's unit tests)
    "test_regions_secagg": {"test_secure_regions_through_the_real_clientapp_on_the_virtual_clock"},
    # real Flower processes
    "test_register_nodes": {
        "superlink",  # the fixture starts a SuperLink with node authentication
        "test_superlink_that_never_answers_gives_a_clear_error_after_the_timeout",  # waits its timeout out
    },
    "test_sweep": {  # real Hydra multiruns through `flwr run`
        "test_two_by_two_sweep_records_a_failure_goes_on_and_skips_completed_jobs_when_rerun",
        "test_a_failing_serverapp_is_recorded_with_flowers_verdict",
        "test_a_sweep_over_a_custom_task_reports_its_primary_metric",
    },
    "test_recovery": {
        "test_a_killed_serverapp_is_stopped_and_resubmitted_until_the_run_completes",  # flwr run
        # federations that wait out a lost node (in process; tests/test_federation.py's
        # vanished node keeps the default run's one case of a lost reply)
        "test_a_lost_node_stops_the_run_cleanly_after_the_bounded_wait_and_resume_finishes_it",
        "test_a_node_back_within_the_wait_rejoins",
        "test_a_round_goes_on_with_the_nodes_left_when_that_is_enough",
        "test_fedbuff_without_nodes_stops_after_the_bounded_wait",
        "test_resume_auto_on_a_completed_run_is_a_successful_no_op",
    },
    "test_local_superlink": {"test_stop_ends_it_and_what_it_started_even_a_process_that_ignores_sigterm"},
    "test_supervise": {"test_the_flwr_cli_against_a_dead_superlink_says_why"},  # the real flwr CLI's time-outs
    "test_data": {"test_hub_dataset_offline_fails_with_what_to_do"},  # the hub client's offline retries
    "test_monitoring": {
        "prometheus",  # the fixture starts a real Prometheus server
        "test_a_running_federation_serves_its_rows",
    },
    "test_tracking": {"test_mlflow_run_gets_params_and_per_round_metrics"},  # MLflow's sqlite store start-up
    "test_distributed": {"test_two_gloo_ranks_equal_one_process_and_a_rank_that_dies_fails_only_its_task"},
    "test_fleet": {
        "test_the_same_seed_gives_the_same_run_whatever_the_number_of_workers",  # four federations
        "test_concurrent_node_threads_parse_one_at_a_time",  # a 240-thread race in a subprocess
        "test_a_node_offline_in_the_trace_gets_no_work_and_fails_the_task_it_was_on",
        "test_a_resumed_fleet_run_continues_its_clock",
        "test_sync_rounds_end_at_the_slowest_reply_or_at_the_simulated_timeout",
    },
    # Federations beyond the default run's one short federation per strategy family. What stays
    # in the default run: FedAvg (test_federation's small federation, screening, a vanished
    # node), a robust rule (test_fedbuff_run's robust buffer), FedBuff (the fleet's hand-computed
    # timeline), central DP (the budget stop), local DP (client epsilon), compression (uplink
    # and downlink), the ledger (one run, verified and tampered with), and every unit test.
    # Measured: docs/testing.md#default-run-timing.
    "test_transformers": {  # federations beyond the one LoRA run and the one classifier
        "test_adapters_compose_with_the_rest_of_the_app",
        "test_a_lora_run_resumes_from_its_checkpoint",
    },
    "test_attacks": {"test_inflated_counts_leave_capped_fedavg_and_multikrum_near_the_clean_run"},
    # an exploded update (attack=scale 1e37): FedAvg and FedBuff with the norm bound, and stalled without it
    "test_norm_bound": {"test_a_run_with_an_exploded_update_completes_and_learns"},
    "test_liveness": {"test_a_run_whose_model_exploded_stops_with_a_reason_and_keeps_its_checkpoint"},
    "test_examples": {  # each example's whole federation in process (tens of seconds to minutes)
        "test_breast_cancer_example_ranks_tumours_well",
        "test_finetune_example_sends_only_the_head_and_keeps_the_body",
        "test_torchvision_example_learns_the_digits",
    },
    "test_own_task": {
        "test_frozen_parameters_never_leave_the_node_and_stay_bit_identical",
        "test_a_custom_task_composes_with_the_rest",  # seven federations
        "test_init_weights_start_the_federation_and_resume_keeps_the_frozen_part",
    },
    "test_federation": {
        "test_resume_past_the_last_round_is_refused",
        "test_krum_keeps_training_under_attack_and_logs_its_choices",
        "test_resume_gives_the_same_rounds_and_model_as_an_uninterrupted_run",
        "test_resume_auto_starts_a_named_run_then_continues_it",
        "test_round_without_valid_replies_keeps_the_model",
        "test_too_few_nodes_fails_clearly_before_any_results",  # a deployment-style bounded wait
        "test_central_evaluation_every_n_rounds_and_always_the_last",
        "test_federated_evaluation_on_client_validation_splits",
    },
    "test_fedbuff_run": {
        "test_a_slow_nodes_stale_updates_are_discarded_or_down_weighted_as_configured",
        "test_runs_stop_at_the_target_accuracy_or_the_wall_clock_budget",
        "test_a_node_that_vanishes_mid_run_does_not_stall_it",
        "test_crashing_tasks_are_counted_and_the_run_goes_on",
        "test_fedbuff_resumes_from_its_version",
    },
    "test_central_dp": {
        "test_exact_values_outside_epsilon_are_recorded_only_when_asked",
        "test_resume_continues_the_accountant_without_double_counting",
        "test_poisson_sampling_draws_cohorts_and_is_accounted_with_its_rate",
        "test_fedbuff_flushes_are_releases_with_q_one",
    },
    "test_local_dp": {
        "test_target_epsilon_is_spent_over_the_planned_rounds_and_not_beyond",
        "test_resumed_run_and_restarted_node_keep_counting_their_clients_epsilon",
        "test_a_node_that_lost_its_context_mid_run_continues_from_the_servers_record",
        "test_per_client_epsilon_survives_a_resume_for_clients_that_do_not_come_back",
        "test_resnet18_is_fixed_to_groupnorm_logged_and_trains_on_the_server_models_keys",
        "test_a_forged_history_cannot_lower_another_nodes_epsilon_and_each_node_gets_only_its_own",
        "test_a_resume_with_more_rounds_keeps_the_accountants_epsilon_within_the_target",
        "test_fedbuff_counts_the_epsilon_of_replies_whose_update_was_rejected",
        "test_fedbuff_records_the_spending_of_tasks_still_out_when_it_stops",
        "test_a_crash_after_federated_evaluation_keeps_the_rounds_privacy_spending",
        "test_a_local_dp_reply_leaves_out_exact_train_metrics_unless_report_exact",
        "test_client_epsilon_rises_every_round_and_matches_the_accountants",
    },
    "test_local_dp_audit": {
        "test_the_servers_checks_accept_every_honest_history_of_a_real_run",
        "test_resume_from_a_poisoned_checkpoint_completes",
        "test_a_node_sending_a_poisoned_history_is_rejected_and_the_run_goes_on",
    },
    "test_ledger": {
        "test_an_old_signature_over_a_truncated_ledger_fails",
        "test_fedbuff_versions_are_on_record",
        "test_a_sign_flipping_node_has_the_lowest_cumulative_contribution_under_fedavg",
        "test_each_task_carries_the_receipt_of_the_nodes_previous_reply",
        "test_fedbuff_versions_score_the_buffer_and_rank_a_sign_flipper_last",
        "test_free_riders_replaying_the_public_step_rank_below_every_honest_node",
        "test_a_node_detects_a_receipt_for_a_reply_it_did_not_send",
        "test_a_signed_ledger_verifies_with_its_public_key_and_a_forgery_fails",
        "test_resume_continues_the_chain_and_the_receipts",
        "test_a_signature_moved_to_another_run_or_config_fails",
        "test_krum_exclusions_and_rejections_are_on_record",
    },
    "test_compression": {
        "test_a_malformed_compressed_reply_is_rejected_with_its_node_and_the_round_goes_on",
    },
    "test_compression_downlink": {
        "test_a_restarted_node_gets_the_whole_model_and_trains_again",
    },
    "test_report": {"test_report_on_real_runs_and_on_a_single_run_dir"},
    "test_live": {"test_the_page_in_a_browser_shows_a_running_federations_curve_grow"},
    "test_status_channel": {
        "test_a_broker_killed_mid_run_neither_slows_nor_changes_training",
        "test_flwr_run_publishes_through_a_real_broker",
    },
    "test_work_records": {
        "test_a_sign_flipper_excluded_by_multikrum_earns_nothing",
        "test_free_riders_with_valid_signatures_earn_nothing_under_any_rule",
        "test_flwr_run_with_a_key_per_simulated_node",
        "test_signed_free_riders_never_earn_more_than_an_honest_node_without_scores",
        "test_a_key_stays_bound_to_its_node_across_a_resume",
    },
    "test_local_deployment": {
        "test_down_stops_exactly_what_up_started_and_never_a_process_that_merely_names_the_state_directory"
    },
}


def _module_name(item: pytest.Item) -> str | None:
    """The module name ("test_x") of a test in tests/test_x.py; None for anything else."""
    module = getattr(item, "module", None)
    path = Path(getattr(module, "__file__", None) or "")
    return path.stem if path.parent == HERE else None


def _check_listed(items: list[pytest.Item]) -> None:
    """Fail collection when a listed module is not in tests/, or a listed name is not defined
    in its module (checked for the modules collected in this session)."""
    missing = [f"tests/{m}.py" for m in sorted({*SLOW_MODULES, *SLOW_TESTS}) if not (HERE / f"{m}.py").is_file()]
    modules = {name: item.module for item in items if (name := _module_name(item)) is not None}
    for name, module in sorted(modules.items()):
        missing += [f"tests/{name}.py::{t}" for t in sorted(SLOW_TESTS.get(name, ())) if not hasattr(module, t)]
    if missing:
        raise pytest.UsageError(
            f"tests/conftest.py marks as slow what does not exist: {', '.join(missing)}; update SLOW_MODULES / SLOW_TESTS"
        )


# CI runs the suite on two pytest-xdist workers (.ci/run: `-n 2 --dist loadgroup`). These
# modules mostly wait (heartbeats, back-off, process start-up) and their timeouts assume one
# federation at a time: they run in order on one worker, first, while the other worker takes
# everything else.
SERIAL_FIRST = ("test_superlink_loopback", "test_secagg_e2e", "test_regions_deployment")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_listed(items)
    for item in items:
        name = _module_name(item)
        listed = SLOW_TESTS.get(name, set())
        by_name = getattr(item, "originalname", item.name) in listed  # every parametrization
        if name in SLOW_MODULES or by_name or listed & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if name in SERIAL_FIRST:
            item.add_marker(pytest.mark.xdist_group("serial-first"))
    items.sort(key=lambda item: _module_name(item) not in SERIAL_FIRST)  # stable: otherwise in file order


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def model_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.normal(size=(4, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.normal(size=(4,)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 4)).astype(np.float32),
    }

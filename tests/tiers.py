"""The tiers chosen from a measured run (docs/testing.md §1), written by tests/tools/select_tiers.py.

``KEEP`` (by hand): fast tests that stay fast, with the bug each catches (the compiled-collective
checks among them: a misplaced collective keeps every number equal). ``FAST_CASES``: for a test
function with several cases, the cases ``make test`` runs; its other cases are ``exhaustive``. ``MOVED`` (written by hand, kept by the script): heavy tests whose behaviour a
cheaper fast test also checks, each with the reason. ``COVERED_ELSEWHERE``: heavy tests every line of
which other fast tests run, moved heaviest first until the fast tier fits its budget; ``exhaustive``.
``SLOW``: tests outside ``make test`` that CI runs every time (the only ones to reach some lines of
``jaxpar/``). tests/conftest.py applies them; a name that matches no test is an error when the whole
suite is collected.
"""

KEEP = {
    'tests/test_equivalence.py::test_explicit_data_parallel_matches[dp2-fsdp2-tp2-zero3]':
        'a dropped data-parallel all-reduce (docs/testing.md §6)',
    'tests/test_byo_model.py::test_explicit_data_parallel_on_two_data_axes_matches':
        "a dropped data-parallel all-reduce, in a user's model (docs/testing.md §6)",
    'tests/test_compression_step.py::test_codec_state_is_checkpointed_bit_exactly[topk-1bit-adam]':
        'a codec state part lost through a checkpoint (docs/testing.md §6)',
    'tests/test_byo_model.py::test_zero3_signature_is_one_flat_gather_and_reduce_scatter_per_layer':
        "the compiled collectives of ZeRO-3 on a user's model: a misplaced gather keeps the numbers",
    'tests/test_explicit_sharding.py::test_collectives_are_the_strategys':
        'the compiled collectives of explicit sharding: a misplaced collective keeps the numbers',
    'tests/test_signatures.py::test_explicit_zero2_over_two_data_axes_is_one_reduce_scatter_per_layer':
        'the compiled reduce-scatters of ZeRO-2: a misplaced collective keeps the numbers',
    'tests/test_signatures.py::test_megatron_forward_collectives_per_block[tp+sp]':
        "the compiled collectives of Megatron's sequence parallelism: a misplaced collective keeps the numbers",
    'tests/test_device_branches.py::test_the_lockstep_program_of_sequence_parallelism_has_no_device_dependent_collective':
        'a device-dependent collective (a hang on a real cluster) that equal numbers on the CPU cannot show',
    'tests/test_signatures.py::test_dp_all_reduces_gradients_and_gathers_nothing':
        'the compiled collectives of data parallelism: a stray gather keeps the numbers',
    'tests/test_signatures.py::test_zero1_all_reduces_gradients_then_gathers_updated_params':
        'the compiled collectives of ZeRO-1: a misplaced collective keeps the numbers',
    'tests/test_relaxed_sync.py::test_diloco_communicates_over_replica_only_at_sync_steps':
        "DiLoCo's compiled exchange over replica only at sync steps: an exchange every step keeps the numbers",
}

MOVED = {
    'tests/test_faults.py::test_exact_resume_after_sigkill':
        "exact resumes run in process (test_async_pipeline::test_train_loop_runs_k_steps_per_call_and_resumes, test_relaxed_sync::test_resume_mid_run_is_bit_exact); a killed run's checkpoints: test_faults::test_corrupt_latest_checkpoint_falls_back_with_warning and the SIGTERM test",
    'tests/test_pairs.py::test_pair_on_two_processes[PP-MP]':
        'two processes against one: test_multiprocess::test_two_processes_match_one_process[zero3_tp]',
    'tests/test_cli.py::test_megatron_config_trains_with_sequence_parallelism_inside_the_pipeline':
        'sequence parallelism inside a pipeline, in process: test_pipeline_sequence_parallel::test_sequence_parallelism_in_a_pipeline_equals_one_device[1f1b]',
    'tests/test_async_pipeline.py::test_no_flush_program_runs_the_table_ticks[2-2]':
        "the versioned stage's tick loop: test_weight_stashing::test_compiled_program_runs_the_table_ticks; 2BW's numbers: test_2bw_equals_delayed_gradient_reference[2-sgd]",
    'tests/test_cli.py::test_explicit_sharding_model_config_trains':
        'explicit-sharding models: tests/test_explicit_sharding.py; YAML user models: test_cli::test_byo_model_config_trains',
    'tests/test_byo_model.py::test_user_model_bf16_compute_trains':
        'bf16 compute: test_models::test_bf16_compute_keeps_fp32_master_weights; user models: test_byo_model::test_user_model_matches_single_device',
    'tests/test_cli.py::test_inspect_compiles_the_programs_that_train_runs':
        "jaxpar inspect: tests/test_cli_plan.py (the quickstart's shardings, collectives and memory); the K-step program: test_async_pipeline::test_train_loop_runs_k_steps_per_call_and_resumes",
    'tests/test_relaxed_sync.py::test_diloco_checkpoint_restores_onto_another_inner_strategy':
        "DiLoCo's state through a checkpoint: test_relaxed_sync::test_resume_mid_run_is_bit_exact[diloco]; a restore onto another layout: test_pipeline::test_pipelined_checkpoint_restores_onto_other_meshes",
    'tests/test_cli_hf.py::test_resume_restores_the_run_without_reading_the_import':
        "resumes: tests/test_newcomer_resume.py and test_faults' SIGTERM resume; the import: test_cli_hf::test_finetune_starts_from_the_checkpoint_weights",
    'tests/test_multiprocess.py::test_each_process_builds_only_its_rows[flags]':
        "each process's rows: the same driver in the [slurm-env] case; the explicit flags: test_two_processes_match_one_process[zero3_tp]",
}

FAST_CASES = {
    'tests/test_byo_model.py::test_explicit_by_default_for_fsdp_in_any_compute_dtype': ['bfloat16'],
    'tests/test_byo_model.py::test_user_model_matches_single_device': ['dp2-zero2-fsdp2-tp2'],
    'tests/test_byo_model.py::test_user_model_pipelined_matches_single_device': ['1f1b-auto'],
    'tests/test_checkpoint.py::test_corrupt_latest_falls_back_to_previous': ['truncate array data'],
    'tests/test_cli.py::test_build_optimizer': ['adam', 'sgd'],
    'tests/test_cli.py::test_user_model_trains_from_yaml': ['dp-fsdp-tp'],
    'tests/test_compression.py::test_deterministic_codecs_error': ['cast-bfloat16', 'cast-float8_e4m3fn', 'cast-float8_e5m2', 'onebit'],
    'tests/test_compression.py::test_error_feedback_conserves_the_gradient': ['topk1'],
    'tests/test_compression_step.py::test_codec_state_is_checkpointed_bit_exactly': ['topk-1bit-adam'],
    'tests/test_compression_step.py::test_codecs_train_under_the_strategies': ['topk-2-1'],
    'tests/test_compression_step.py::test_lossless_settings_match_the_uncompressed_step': ['topk-1-2'],
    'tests/test_compression_step.py::test_wire_bytes_in_the_compiled_step': ['powersgd'],
    'tests/test_context_attention.py::test_collectives_are_the_methods_over_context_only': ['all_gather-context2-causal-seg-kv2-nat', 'all_gather-context4-full-noseg-kv8-bal', 'all_gather-context8-causal-seg-kv2-bal', 'all_gather-data2xcontext4-causal-seg-kv2-nat', 'ring-context4-full-seg-kv2-nat', 'ulysses-context2-causal-seg-kv2-bal', 'ulysses-context4-full-noseg-kv8-nat', 'ulysses-context4xtensor2-causal-seg-kv2-bal'],
    'tests/test_context_attention.py::test_context_parallel_matches_one_device': ['all_gather-context2-causal-seg-kv2-nat', 'all_gather-context4-full-noseg-kv8-bal', 'all_gather-data2xcontext4-causal-seg-kv2-nat', 'ulysses-context4-full-noseg-kv8-nat'],
    'tests/test_context_attention.py::test_context_parallel_window_and_softcap_match_one_device': ['all_gather-context2-nat-static3-capNone-full', 'all_gather-context4-bal-traced6-cap2.0-causal', 'ring-context4-nat-static3-cap2.0-causal', 'ring-context4-nat-static5-capNone-full', 'ulysses-context2-nat-traced6-capNone-causal', 'ulysses-context4-bal-static3-cap2.0-causal'],
    'tests/test_context_attention.py::test_one_device_is_the_reference': ['True-False-8'],
    'tests/test_context_attention.py::test_ring_forward_passes_kv_c_minus_1_times': ['2-True'],
    'tests/test_context_train.py::test_context_parallel_training_matches_one_device': ['packed-cp2-ulysses-dp2'],
    'tests/test_context_train.py::test_shapes_the_context_axis_cannot_split_are_named': ['axes1-strategy1-heads'],
    'tests/test_context_train.py::test_the_compiled_step_runs_the_methods_collectives_over_context': ['all_gather'],
    'tests/test_cost_compiled.py::test_bytes_per_axis_and_arguments_match_the_compiled_step': ['pp2-1f1b-m4-dp4'],
    'tests/test_data_tokenizers.py::test_decode_inverts_encode': ['sentencepiece', 'tiktoken'],
    'tests/test_data_tokenizers.py::test_ids_equal_the_reference_library': ['sentencepiece', 'tiktoken'],
    'tests/test_doctests.py::test_docstring_examples_run': ['jaxpar', 'jaxpar.adapters', 'jaxpar.adapters._blocks', 'jaxpar.adapters._layer_lists', 'jaxpar.adapters._loss_metrics', 'jaxpar.adapters._mesh_axes', 'jaxpar.analysis', 'jaxpar.analysis._axis_bytes', 'jaxpar.analysis._compiled_memory', 'jaxpar.analysis._device_branches', 'jaxpar.analysis._gemms', 'jaxpar.analysis._hlo', 'jaxpar.analysis._hlo_text', 'jaxpar.analysis._loops', 'jaxpar.analysis._overlap', 'jaxpar.analysis._replica_groups', 'jaxpar.analysis._sharding_table', 'jaxpar.analysis._windowed', 'jaxpar.batch', 'jaxpar.cli', 'jaxpar.commands._check_command', 'jaxpar.commands._inspect_command', 'jaxpar.commands._plan_command', 'jaxpar.compat', 'jaxpar.compat._markdown', 'jaxpar.compat._needs', 'jaxpar.compat._settings', 'jaxpar.compat._table', 'jaxpar.config', 'jaxpar.config._build', 'jaxpar.config._checks', 'jaxpar.config._data_section', 'jaxpar.config._documents', 'jaxpar.config._hf_model', 'jaxpar.config._imports', 'jaxpar.config._load', 'jaxpar.config._optimizer_section', 'jaxpar.config._schema', 'jaxpar.cost._cluster', 'jaxpar.cost._collectives', 'jaxpar.cost._context_experts', 'jaxpar.cost._device_bytes', 'jaxpar.cost._memory', 'jaxpar.cost._model', 'jaxpar.cost._parallel', 'jaxpar.cost._planner', 'jaxpar.cost._roofline', 'jaxpar.cost._schedule', 'jaxpar.cost._time', 'jaxpar.cost._traffic', 'jaxpar.data', 'jaxpar.data._cache', 'jaxpar.data._loader', 'jaxpar.data._packing', 'jaxpar.data._row_plan', 'jaxpar.data._rows', 'jaxpar.data._tokenizers', 'jaxpar.data._tokens', 'jaxpar.data._windows', 'jaxpar.data.sources', 'jaxpar.data.sources._base', 'jaxpar.data.sources._columnar', 'jaxpar.data.sources._jsonl', 'jaxpar.devices', 'jaxpar.devices._distributed', 'jaxpar.devices._targets', 'jaxpar.errors', 'jaxpar.hf', 'jaxpar.hf._boxes', 'jaxpar.hf._config', 'jaxpar.hf._export', 'jaxpar.hf._files', 'jaxpar.hf._keys', 'jaxpar.hf._reader', 'jaxpar.mesh', 'jaxpar.models', 'jaxpar.models._decoder_layers', 'jaxpar.models._gpt_layers', 'jaxpar.models._gpt_moe', 'jaxpar.models._mlp', 'jaxpar.parallel', 'jaxpar.parallel._fp8', 'jaxpar.parallel._regions', 'jaxpar.parallel._tensor', 'jaxpar.parallel._zero', 'jaxpar.parallel.compression', 'jaxpar.parallel.compression._base', 'jaxpar.parallel.compression._bits', 'jaxpar.parallel.compression._codecs', 'jaxpar.parallel.compression._sparse', 'jaxpar.parallel.context._softmax', 'jaxpar.parallel.context._options', 'jaxpar.parallel.context._zigzag', 'jaxpar.parallel.moe._balance', 'jaxpar.parallel.moe._dispatch', 'jaxpar.parallel.pipeline', 'jaxpar.parallel.pipeline._buffers', 'jaxpar.parallel.pipeline._cut', 'jaxpar.parallel.pipeline._instructions', 'jaxpar.parallel.pipeline._layer_vjp', 'jaxpar.parallel.pipeline._partition', 'jaxpar.parallel.pipeline._pipedream', 'jaxpar.parallel.pipeline._render', 'jaxpar.parallel.pipeline._schedules', 'jaxpar.parallel.pipeline._stage', 'jaxpar.parallel.pipeline._sweep', 'jaxpar.parallel.sync', 'jaxpar.parallel.sync._kinds', 'jaxpar.plan._inspect_lines', 'jaxpar.plan._plan_report', 'jaxpar.plan._prediction', 'jaxpar.rules', 'jaxpar.run', 'jaxpar.run._checkpoint', 'jaxpar.run._preemption', 'jaxpar.run._ramp', 'jaxpar.run._memory_meter', 'jaxpar.run._metrics', 'jaxpar.run._progress', 'jaxpar.run._summary', 'jaxpar.run._resume', 'jaxpar.run._sample', 'jaxpar.run._state_parts', 'jaxpar.step', 'jaxpar.step._balancing', 'jaxpar.step._compose', 'jaxpar.step._init', 'jaxpar.step._local_steps', 'jaxpar.step._noise_scale', 'jaxpar.step._program', 'jaxpar.step._stashing_step', 'jaxpar.step._state', 'jaxpar.step._two_bw_step', 'jaxpar.step._update', 'jaxpar.strategy'],
    'tests/test_equivalence.py::test_explicit_data_parallel_matches': ['dp2-fsdp2-tp2-zero3'],
    'tests/test_equivalence.py::test_strategy_matches_single_device': ['tp8-sp-noaccum'],
    'tests/test_executor_buffers.py::test_no_residual_slot_is_copied_in_the_tick_loop': ['zb-h1'],
    'tests/test_explicit_sharding.py::test_explicit_style_model_is_exact_against_one_device': ['dp2-fsdp2-tp2-zero3-accum2'],
    'tests/test_flax_example_style.py::test_the_example_style_model_is_exact_against_one_device': ['one-device'],
    'tests/test_hf.py::test_bf16_agrees_with_transformers_in_bf16': ['qwen3'],
    'tests/test_hf.py::test_packed_row_equals_documents_alone': ['gemma3'],
    'tests/test_large_batch_optim.py::test_strategy_matches_single_device': ['zero3-lars'],
    'tests/test_large_batch_optim.py::test_trust_ratio_collectives': ['zero3'],
    'tests/test_layer_lists.py::test_stacked_list_is_exact_against_the_list_on_one_device': ['scan-fsdp4-tp2-zero3'],
    'tests/test_memory.py::test_argument_bytes_match_zero_formula': ['fsdp', 'zero2', 'zero3'],
    'tests/test_mesh_axis_specs.py::test_mesh_axis_model_trains_exactly_without_rules': ['axes2-0'],
    'tests/test_models.py::test_bf16_compute_keeps_fp32_master_weights': ['fsdp8-explicit'],
    'tests/test_models.py::test_mlp_classifier_matches_single_device': ['dp8-zero2'],
    'tests/test_models.py::test_remat_policies_do_not_change_numbers': ['save-matmuls-dp2-tp4'],
    'tests/test_moe.py::test_expert_parallel_matches_one_device': ['fsdp2xexpert4'],
    'tests/test_moe.py::test_gated_experts_on_one_device_are_the_hugging_face_formula': ['swiglu-raw_probs-shared'],
    'tests/test_moe.py::test_gated_experts_under_expert_parallelism_match_one_device': ['data2xexpert2-cf1'],
    'tests/test_moe.py::test_one_device_matches_a_loop_over_tokens': ['top_k=2-gate=sigmoid-capacity_factor=None'],
    'tests/test_moe_train.py::test_a_router_bias_without_one_load_per_step_is_refused_by_the_table': ['ST'],
    'tests/test_moe_train.py::test_expert_parallel_training_matches_one_device': ['ep2-fsdp2-tp2-zero3-shared'],
    'tests/test_moe_user_model.py::test_a_plain_loss_equals_one_device': ['direct-accumulate4'],
    'tests/test_noise_scale.py::test_measured_norms_equal_materialised_per_replica_gradients': ['dp8'],
    'tests/test_onebit_adam.py::test_adam_first_moment_is_the_exchanged_compressed_moment': ['sign'],
    'tests/test_pairs.py::test_pair_matches_its_reference': ['BF-CK', 'CP-MU', 'RM-ST', 'TP-EP', 'Z-F8'],
    'tests/test_partition.py::test_stage_layout_round_trips': ['stage_layers0-1', 'stage_layers2-2', 'stage_layers3-2'],
    'tests/test_pipeline.py::test_composed_pipeline_trains_like_single_device': ['pp2-interleaved-dp2-tp2'],
    'tests/test_pipeline.py::test_remat_policies_inside_the_pipeline': ['full'],
    'tests/test_pipeline.py::test_schedule_matches_single_device': ['zb-h1-p4-m4'],
    'tests/test_pipeline.py::test_sends_are_neighbour_permutes_matching_the_table': ['1f1b-1'],
    'tests/test_pipeline_sequence_parallel.py::test_the_lockstep_executor_equals_the_per_stage_program_with_uneven_stages': ['zb-h1'],
    'tests/test_plan_compat.py::test_every_ranked_plan_passes_the_table': ['gpt2-124m-cpu_sim', 'gpt2-124m-h100', 'gpt2-124m-tpu_v5e', 'moe-8k-h100', 'small-cpu_sim', 'small-h100', 'small-tpu_v5e'],
    'tests/test_relaxed_sync.py::test_diloco_composes_with_inner_strategies': ['tp2'],
    'tests/test_relaxed_sync.py::test_no_delay_and_no_backup_equal_synchronous_training_exactly': ['s3-zero-delays'],
    'tests/test_schedules.py::test_zb_h1_beats_1f1b_for_every_m': ['1', '2', '3', '4'],
    'tests/test_signatures.py::test_megatron_forward_collectives_per_block': ['tp+sp'],
    'tests/test_signatures.py::test_zero2_and_3_reduce_scatter_gradients_per_layer': ['zero2'],
    'tests/test_step_parts.py::test_the_replicas_own_gradients_average_to_the_global_one': ['0'],
    'tests/test_update_grad_norm.py::test_one_update_per_step_reports_the_norm_of_the_averaged_gradient': ['sync-replicas'],
    'tests/test_update_grad_norm.py::test_replicas_that_update_on_their_own_report_the_rms_of_their_norms': ['async'],
    'tests/test_xla_cpu_reproducers.py::test_bf16_reduction_in_a_partly_manual_region_compiles': ['psum_size1_automatic_axis'],
}

COVERED_ELSEWHERE = [
    'tests/test_bf16_sequence_parallel.py::test_the_bf16_sequence_parallel_step_with_data_compiles_for_gpu_in_bf16',
    'tests/test_byo_model.py::test_auto_stage_layers_measure_the_users_layers',
    'tests/test_checkpoint.py::test_nonfinite_step_is_skipped_and_reported',
    'tests/test_checkpoint.py::test_resume_with_older_weight_versions_switched_off',
    'tests/test_cli.py::test_train_end_to_end_in_process',
    'tests/test_cli.py::test_user_model_trains_from_yaml[dp-fsdp-tp]',
    'tests/test_cli_plan.py::test_inspect_prints_shardings_collectives_and_memory_next_to_the_model',
    'tests/test_compression_step.py::test_codecs_train_under_the_strategies[topk-2-1]',
    'tests/test_compression_step.py::test_local_clip_clips_each_replica_before_the_codec',
    'tests/test_compression_step.py::test_lossless_settings_match_the_uncompressed_step[topk-1-2]',
    'tests/test_compression_step.py::test_restore_onto_other_replicas_resets_the_codec_state_with_a_warning',
    'tests/test_compression_train.py::test_train_prints_and_logs_wire_bytes',
    'tests/test_context_attention.py::test_nested_in_a_shard_map_manual_over_pipe',
    'tests/test_context_train.py::test_the_ring_in_a_pipeline_stage_hops_by_all_gather_on_cpu',
    'tests/test_equivalence.py::test_strategy_matches_single_device[tp8-sp-noaccum]',
    'tests/test_equivalence.py::test_xla_managed_data_parallel_matches',
    'tests/test_executor_buffers.py::test_no_residual_slot_is_copied_in_the_tick_loop[zb-h1]',
    'tests/test_explicit_sharding.py::test_checkpoint_restores_onto_another_mesh_and_training_goes_on',
    'tests/test_explicit_sharding.py::test_explicit_style_model_is_exact_against_one_device[dp2-fsdp2-tp2-zero3-accum2]',
    'tests/test_flax_example_style.py::test_the_example_style_model_is_exact_against_one_device[one-device]',
    'tests/test_hlo.py::test_a_tpu_program_counts_each_channel_once',
    'tests/test_layer_lists.py::test_a_list_whose_layers_differ_stays_a_list_and_a_pipeline_names_the_difference',
    'tests/test_layer_lists.py::test_pipeline_stages_hold_their_layers_only',
    'tests/test_layer_lists.py::test_stacked_list_is_exact_against_the_list_on_one_device[scan-fsdp4-tp2-zero3]',
    'tests/test_mesh_rules.py::test_batch_not_divisible_by_data_axes',
    'tests/test_models.py::test_remat_policies_do_not_change_numbers[save-matmuls-dp2-tp4]',
    'tests/test_models.py::test_scan_and_loop_agree',
    'tests/test_moe.py::test_module_is_moe_apply_on_its_parameters',
    'tests/test_moe.py::test_one_device_matches_a_loop_over_tokens[top_k=2-gate=sigmoid-capacity_factor=None]',
    'tests/test_moe_train.py::test_step_metrics_with_drops_match_one_device[axes0-strategy0]',
    'tests/test_moe_train.py::test_the_aux_loss_with_accumulation_is_the_whole_batchs[axes1-2]',
    'tests/test_moe_train.py::test_the_compiled_step_dispatches_with_all_to_alls_and_keeps_the_experts_sharded',
    'tests/test_moe_user_model.py::test_a_plain_loss_equals_one_device[direct-accumulate4]',
    'tests/test_moe_user_model.py::test_without_micro_batches_the_plain_loss_needs_nothing',
    'tests/test_newcomer_resume.py::test_resume_before_the_end_names_the_original_length_and_same_length_is_quiet',
    'tests/test_noise_scale.py::test_measured_norms_equal_materialised_per_replica_gradients[dp8]',
    'tests/test_onebit_adam.py::test_adam_first_moment_is_the_exchanged_compressed_moment[sign]',
    'tests/test_onebit_adam.py::test_before_start_step_it_is_adamw_with_the_exact_exchange',
    'tests/test_overlap.py::test_a_tpu_step_counts_its_layer_loop_from_the_condition',
    'tests/test_pairs.py::test_bf16_under_every_schedule[pipedream-2bw]',
    'tests/test_pipeline.py::test_1f1b_memory_is_bounded_and_gpipe_grows[1f1b]',
    'tests/test_pipeline.py::test_auto_stage_layers_balance_compiled_flops',
    'tests/test_pipeline.py::test_composed_pipeline_trains_like_single_device[pp2-interleaved-dp2-tp2]',
    'tests/test_pipeline.py::test_remat_policies_inside_the_pipeline[full]',
    'tests/test_pipeline.py::test_schedule_matches_single_device[zb-h1-p4-m4]',
    'tests/test_pipeline.py::test_sends_are_neighbour_permutes_matching_the_table[1f1b-1]',
    'tests/test_pipeline_metrics.py::test_pipelined_steps_return_what_the_loss_reports[strategy0-1]',
    'tests/test_plan_compat.py::test_top_plan_of_a_cpu_mesh_case_trains',
    'tests/test_readme.py::test_readme_api_example_runs',
    'tests/test_relaxed_sync.py::test_diloco_composes_with_inner_strategies[tp2]',
    'tests/test_relaxed_sync.py::test_restore_onto_another_number_of_replicas_restarts_them_from_the_outer_params',
    'tests/test_relaxed_sync.py::test_synchronous_replicas_equal_data_parallelism',
    'tests/test_split_backward.py::test_gpt_block_b_plus_w_is_the_pullback_and_each_matmul_runs_once',
    'tests/test_targets.py::test_zero3_gathers_and_scatters_over_data_asynchronously',
    'tests/test_token_files.py::test_train_on_a_token_file',
    'tests/test_two_bw_skip.py::test_no_flush_program_gives_the_one_step_programs_states[3]',
    'tests/test_two_bw_skip.py::test_one_step_program_skips_and_makes_the_newest_version_the_older_one',
    'tests/test_update_grad_norm.py::test_one_update_per_step_reports_the_norm_of_the_averaged_gradient[sync-replicas]',
    'tests/test_weight_stashing.py::test_checkpoint_of_another_schedule_restores_into_stashing_and_back',
    'tests/test_weight_stashing.py::test_stashing_is_not_the_flushed_step',
]

SLOW = [
    'tests/test_cli.py::test_inspect_compiles_the_programs_that_train_runs',
    'tests/test_cli.py::test_long_context_config_trains_over_a_context_axis',
    'tests/test_cli.py::test_megatron_config_compiles_for_h100',
    'tests/test_cli.py::test_moe_config_trains_over_an_expert_axis',
    'tests/test_compression_step.py::test_codec_state_is_checkpointed_bit_exactly[topk-momentum]',
    'tests/test_compression_step.py::test_codec_strategy_matrix[randomk-0-1]',
    'tests/test_cost_compiled.py::test_bytes_per_axis_and_arguments_match_the_compiled_step[dp2-zero2-fsdp2-tp2-sp]',
    'tests/test_cost_verify.py::test_plan_verify_target_predicts_the_gpu_compilers_peak',
    'tests/test_device_branches.py::test_bf16_sequence_parallelism_on_targets_has_no_device_dependent_collective[tpu-v5e:4x4-pipe2xdata2xtensor4]',
    'tests/test_hf.py::test_every_layout_trains_like_one_device[cp2-ring-packed]',
    'tests/test_moe_train.py::test_expert_parallel_training_matches_one_device[ep2-pipe2-tp2-sp-1f1b]',
    'tests/test_moe_train.py::test_expert_parallel_training_matches_one_device[ep4-tp2-every2]',
    'tests/test_pairs.py::test_pair_matches_its_reference[NS-1A]',
    'tests/test_pairs.py::test_pair_matches_its_reference[EP-F8]',
    'tests/test_relaxed_sync.py::test_easgd_with_zero_alpha_gives_independent_runs',
    'tests/test_relaxed_sync.py::test_stale_gradients_match_a_sequential_reference[ssp]',
    'tests/test_targets.py::test_a_model_too_big_is_reported_with_the_plan_that_fits',
    'tests/test_targets.py::test_compression_sends_the_packed_codes[onebit_adam.yaml]',
    'tests/test_targets.py::test_compression_sends_the_packed_codes[topk.yaml]',
    'tests/test_targets.py::test_configs_compile_for_gpu_and_tpu[quickstart.yaml-tpu-v5e:2x4]',
    'tests/test_targets.py::test_expert_parallelism_dispatches_with_asynchronous_all_to_alls_on_gpus',
]

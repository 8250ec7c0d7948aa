"""The planner's reports: the cost model's prediction beside a compiled or a running train step
(``jaxpar inspect``'s table, ``jaxpar train``'s predicted peak, ``jaxpar profile``'s terms), ``jaxpar plan``'s
ranked plans with their overrides (ranked by the one call both ``plan`` and ``inspect`` make, :func:`rank_plans`),
``--verify``'s table, and ``jaxpar inspect``'s sections on a compiled step. They take the cost
model's model and plan, the state's layout and compiled programs; the commands (:mod:`jaxpar.commands`) read the
config and pass them.
"""
from jaxpar.plan._inspect_lines import (attention_lines, collective_lines, expert_lines, fit_lines, fitting_plan, fp8_lines,
                                        gather_lines, muon_lines, muon_placement_lines, offload_lines, on_target,
                                        sharding_lines)
from jaxpar.plan._plan_report import (chosen_plan, fp8_cluster_problem, fp8_line, gpt_check, offload_line,
                                      plan_overrides, plan_report, verify_devices, verify_plans, yaml_text)
from jaxpar.plan._prediction import (RUN_CLUSTERS, PlannerView, compiled_check, planner_table, planner_view,
                                     platform_of, predicted_rows, profile_report, run_prediction,
                                     RunPrediction)
from jaxpar.plan._ranking import PlanOptions, plan_fields, rank_plans, same_plan

__all__ = ["attention_lines", "collective_lines", "expert_lines", "fit_lines", "fitting_plan", "fp8_lines", "gather_lines", "muon_lines",
           "muon_placement_lines", "offload_lines", "on_target", "sharding_lines", "chosen_plan", "fp8_cluster_problem", "fp8_line", "offload_line",
           "gpt_check", "plan_overrides", "plan_report", "verify_devices", "verify_plans", "yaml_text", "RUN_CLUSTERS",
           "PlannerView", "compiled_check", "planner_table", "planner_view", "platform_of", "predicted_rows",
           "profile_report", "run_prediction", "RunPrediction", "PlanOptions", "plan_fields",
           "rank_plans", "same_plan"]

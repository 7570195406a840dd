"""Reports: aggregate tables, figures and REPORT.md from run directories.

Commands, their outputs and the RUN_DIR convention: docs/results.md, "Report commands".

Modules, by what they produce:
  runs            finding and reading run directories (config, status, training log, eval JSONs), validated
  groups          runs grouped by size × condition, per-run values, `Table`, notes under tables
  tables          every table of the report (`build_tables`), per_seed.csv included
  figures         every figure
  claims          the paper's claims: rules, thresholds, verdicts (records: one record per run,
                  from a run directory or from per_seed.csv); dose: the dose-response rules D1–D4;
                  claims_matrix: claims × experiments
  extrapolation   one experiment's ‖H_K‖ over training steps, fitted and extrapolated to the
                  paper's lengths (drift.csv)
  drift_law       the law across experiments (results/drift_law)
  endpoint_scale  the paper's endpoint-scale story (loss placement × scale visibility)
  appendix_b      Appendix B's tables (Ouro track)
  document        REPORT.md, and the endpoint-scale story's files (`loopscale eval story`)
  metrics         metrics.json for DVC
  markdown        number formatting and Markdown tables
  paper           the paper's numbers
"""


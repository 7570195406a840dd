"""Reports: aggregate tables, figures and REPORT.md from run directories.

Command line (loopscale.cli.report):

  loopscale report tables  --runs RUN_DIR [RUN_DIR ...] --out results/<exp>
                           [--claims paper|factorial|dose] [--preregistered studies/<name>/preregistration.md]
      writes <out>/{main,depth,norms,radial,lemma,clamp,scale,halting,halting_paper,story,drift,runs,
      claims,choices}.{csv,md} (claims: evidence and sanity checks; choices: each claim per seed under the
      researcher's choices), with --claims dose also <out>/dose.{csv,md}
      and <out>/norm_loops.csv, <out>/train_norms.csv, <out>/per_seed.csv (tidy: one row per run × exit k),
      <out>/metrics.json (headline numbers per condition, for DVC); for Ouro runs also
      <out>/appendix_b.{csv,md} (Appendix B: variable depth K = 1..8, downstream accuracy)
  loopscale report figures --runs RUN_DIR [RUN_DIR ...] --out results/<exp>/figures
      writes <out>/{norm_per_loop,norm_training,ppl_depth,frontier,frontier_exits,radial_vs_norm,
      norm_histogram,lemma,scale,exit_training,drift,story_quadrant}.{png,pdf} (every file is always written; a
      panel without data says so); with --claims dose also dose.{png,pdf}
  loopscale report write   --runs RUN_DIR [RUN_DIR ...] --results results/<exp>
                           [--figures results/<exp>/figures] [--params params.yaml]
                           [--experiment <exp>] --out results/<exp>/REPORT.md
      writes the one report file; it recomputes everything from the runs and links the
      CSVs in --results (and appendix_b.md of an Ouro experiment) and the PNGs in --figures
      by paths relative to --out
  loopscale report claims --results results/<exp> [--claims ...] [--preregistered ...] [--out DIR]
      rebuilds claims/choices (and dose) tables from the committed per_seed.csv + train_norms.csv,
      without the run directories
  loopscale report claims-matrix --results results/<exp> [results/<exp> ...] --out results/claims_matrix
      writes claims_matrix.{csv,md}: every claim × experiment (and arm), ✓ k/n / ✗ / mixed k/n / –;
      with --readme COLUMNS also claims_matrix_readme.md (those columns, the rest summarised), and
      with --splice README.md that view between the README's claims-matrix markers

A RUN_DIR is a directory holding config.json / config.yaml / summary.json / metrics.jsonl;
any other directory given is searched recursively for such run directories, so
`--runs runs/<exp>` works too. The order of the runs given does not matter. Every output
is written atomically and is a pure function of the inputs (no timestamps), so the same
runs give the same bytes.

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


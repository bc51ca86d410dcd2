/* cli.h - the `tandem` subcommands (main.c dispatches on argv[1]). Each
 * returns the process exit status. */
#ifndef TANDEM_CLI_H
#define TANDEM_CLI_H

#include <stdio.h>

int cli_run(int argc, char **argv);        /* tandem run */
int cli_tokenize(int argc, char **argv);   /* tandem tokenize */
int cli_bench(int argc, char **argv);      /* tandem bench (bench.c) */
int cli_gen_model(int argc, char **argv);  /* tandem gen-model (genmodel.c) */
int cli_serve(int argc, char **argv);      /* tandem serve (serve.c) */
int cli_bench_handoff(int argc, char **argv); /* tandem bench-handoff (bench_handoff.c) */
int cli_bench_serve(int argc, char **argv);   /* tandem bench-serve (bench_serve.c) */
int cli_cache(int argc, char **argv);         /* tandem cache save|load (cache.c) */
int cli_chain_plan(int argc, char **argv);    /* tandem chain-plan (chain_plan.c) */

/* ==== Version ==== */

/* "tandem VERSION (git COMMIT)" and the build's features, on f. */
void cli_print_version(FILE *f);

/* "NAME (this CPU runs: ref ... )": the kernel set in use and every set this
 * CPU runs (tandem --version, tandem bench). */
void cli_print_kernel_sets(FILE *f);

#endif

/* cli.h - the `tandem` subcommands (main.c dispatches on argv[1]). Each
 * returns the process exit status. */
#ifndef TANDEM_CLI_H
#define TANDEM_CLI_H

int cli_run(int argc, char **argv);        /* tandem run */
int cli_tokenize(int argc, char **argv);   /* tandem tokenize */
int cli_bench(int argc, char **argv);      /* tandem bench (bench.c) */
int cli_gen_model(int argc, char **argv);  /* tandem gen-model (genmodel.c) */
int cli_serve(int argc, char **argv);      /* tandem serve (serve.c) */
int cli_bench_handoff(int argc, char **argv); /* tandem bench-handoff (bench_handoff.c) */
int cli_bench_serve(int argc, char **argv);   /* tandem bench-serve (bench_serve.c) */
int cli_grade(int argc, char **argv);         /* tandem grade (grade.c) */

/* ==== Helpers shared by the subcommands ==== */
#include <stddef.h>
#include <stdint.h>
uint32_t cli_kv_type(const char *s);                  /* "f16"/"bf16"/"q8_0" -> ggml type, UINT32_MAX if unknown */
/* --backend NAME / --device N: 0 if valid ("cpu" or "cuda"; a device 0..63). */
int cli_backend_ok(const char *name);
int cli_device_ok(const char *s, int *out);
/* --backend NAME with "CMD: --backend: 'x' is not one of cpu|cuda" when wrong. */
int cli_backend_check(const char *cmd, const char *v, const char **out);
/* Usage lines for --backend and --device (option column `width` wide), on
 * stderr or on f. */
#include <stdio.h>
void cli_usage_backend(int width);
void cli_usage_backend_to(FILE *f, int width);
char *cli_read_file(const char *path, size_t *len);   /* whole file, NUL-terminated; NULL on failure */
/* The shared node secret from FILE (or env TANDEM_SECRET when file is NULL),
 * trailing newline stripped; refuses an empty one. Caller frees *out. */
int cli_load_secret(const char *file, char **out, size_t *len, char *err, size_t errlen);
/* The prompt's token ids (chat-wrapped if asked), malloc'd; NULL with a message. (cli.c) */
struct model;
int32_t *cli_tokenize_prompt(struct model *m, const char *text, int chat, int *n_out, char *err, size_t errlen);

#endif

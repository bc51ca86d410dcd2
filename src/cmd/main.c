/* main.c - the `tandem` command: dispatch to the subcommands in cli.h. */
#include <stdio.h>
#include <string.h>

#include "cmd/cli.h"
#include "grade/grade.h"
#include "base/cliopt.h"

static void main_usage(FILE *f) {
    fprintf(f,
        "tandem - disaggregated LLM inference over GGUF models\n"
        "usage: tandem COMMAND [options]\n"
        "  run         generate text from a prompt\n"
        "  tokenize    print the token ids of a text\n"
        "  bench       prompt and generation speed (llama-bench style table, or -o json|csv)\n"
        "  gen-model   write a random-weight GGUF model of a given shape\n"
        "  serve       run a node: --role prefill | decode | local | router\n"
        "  bench-handoff  KV handoff cost: time to first token split vs one node\n"
        "  bench-serve    serving benchmark of an OpenAI-compatible server (t/s, TTFT, TPOT)\n"
        "  grade       grade a class of code submissions against a rubric through a router\n"
        "  cache       save a prefix (a rubric) to a decode node's KV store on disk, or load it\n"
        "  chain-plan  where to cut a model into the slices of a layer-split prefill chain\n"
        "  --version   version, commit and build features\n"
        "`tandem COMMAND --help` shows a command's options.\n"
        "Exit status: 0 success, 1 failure at run time, 2 bad command line.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) { main_usage(stderr); return CLI_EXIT_USAGE; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "run")) return cli_run(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return cli_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) return cli_bench(argc - 2, argv + 2);
    if (!strcmp(cmd, "gen-model")) return cli_gen_model(argc - 2, argv + 2);
    if (!strcmp(cmd, "serve")) return cli_serve(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench-handoff")) return cli_bench_handoff(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench-serve")) return cli_bench_serve(argc - 2, argv + 2);
    if (!strcmp(cmd, "grade")) return cli_grade(argc - 2, argv + 2);
    if (!strcmp(cmd, "cache")) return cli_cache(argc - 2, argv + 2);
    if (!strcmp(cmd, "chain-plan")) return cli_chain_plan(argc - 2, argv + 2);
    if (cliopt_is_help(cmd) || !strcmp(cmd, "help")) { main_usage(stdout); return CLI_EXIT_OK; }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) { cli_print_version(stdout); return CLI_EXIT_OK; }
    fprintf(stderr, "tandem: unknown command '%s'\n", cmd);
    main_usage(stderr);
    return CLI_EXIT_USAGE;
}

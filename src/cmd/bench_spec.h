/* bench_spec.h - `tandem bench`'s speculative mode (bench_spec.c). */
#ifndef TANDEM_BENCH_SPEC_H
#define TANDEM_BENCH_SPEC_H

/* 1 when the command line asks for it (--draft-model or --lookup). */
int bench_spec_wanted(int argc, char **argv);
/* The mode's own command line (bench's arguments); the exit status. */
int bench_spec_main(int argc, char **argv);

#endif

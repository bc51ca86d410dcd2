/* version.h - the one place the version of tandem is written. */
#ifndef TANDEM_VERSION_H
#define TANDEM_VERSION_H

#define TANDEM_VERSION "0.1.0"

/* The git commit, injected by the Makefile (-DTANDEM_GIT=...) when the
 * sources are a git checkout. */
#ifndef TANDEM_GIT
#define TANDEM_GIT "unknown"
#endif

#endif

/* backend_mlx_absent.c - the MLX entry points of a build without MLX.
 *
 * The backend choice is made at run time (model.c asks for "mlx" by
 * name), so the library is the same in every build: this file is part of
 * libtandem.a, and `make mlx` links build-mlx/obj/mlx/backend_mlx.o ahead
 * of the same archive. That object defines every symbol here, so the
 * linker never takes this member then (an archive member is pulled only
 * for a symbol still undefined); a symbol defined here and not there would
 * pull it and fail the link with a duplicate definition, loudly. Only the
 * MLX object and the link differ between the two builds: nothing is
 * compiled twice. */
#include "engine/backend.h"

#include <stdio.h>

/* ==== Entry points ==== */

backend *backend_mlx_create(int n_threads, char *err, size_t errlen) {
    (void)n_threads;
    snprintf(err, errlen, "this build has no MLX backend (tools/mlx_build.sh, then make MLX=1 mlx)");
    return NULL;
}

int backend_mlx_linked(void) { return 0; }

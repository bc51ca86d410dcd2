/* selftest: a binary that crashes after a passing check, before its summary. */
#include <signal.h>
#include "t.h"
int main(void) {
    CHECK(1, "passes");
    fflush(stdout);
    raise(SIGSEGV);
    return t_done("st_crash");
}

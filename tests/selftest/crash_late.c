/* selftest: a binary that prints a clean summary and then dies (a crash in
 * teardown): its checks count, and so does the crash. */
#include "t.h"
int main(void) {
    CHECK(1, "passes");
    t_done("st_crash_late");
    fflush(stdout);
    abort();
}

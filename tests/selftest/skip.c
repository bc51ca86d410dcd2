/* selftest: one passing check and one skip of SELFTEST_WHAT (default
 * "selftest-thing"): counted, or a failure where TANDEM_REQUIRE names it. */
#include "t.h"
int main(void) {
    const char *what = getenv("SELFTEST_WHAT");
    CHECK(1, "passes");
    t_skip_what(what && *what ? what : "selftest-thing", "deliberately absent (tests/selftest.sh)");
    return t_done("st_skip");
}

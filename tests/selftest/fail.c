/* selftest: one passing and one failing check. */
#include "t.h"
int main(void) {
    CHECK(1, "passes");
    CHECK(0, "fails on purpose (tests/selftest.sh)");
    return t_done("st_fail");
}

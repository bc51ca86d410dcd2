/* selftest: one passing check (the baseline every other case is set against). */
#include "t.h"
int main(void) {
    CHECK(1 + 1 == 2, "arithmetic");
    return t_done("st_pass");
}

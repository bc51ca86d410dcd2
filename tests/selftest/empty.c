/* selftest: a binary that checks nothing and skips nothing (t_done fails it). */
#include "t.h"
int main(void) {
    return t_done("st_empty");
}

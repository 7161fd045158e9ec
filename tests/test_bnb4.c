#include <criterion/criterion.h>
Test(placeholder, builds) { cr_assert(1); }

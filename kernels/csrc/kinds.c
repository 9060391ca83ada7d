/* The kind codes this library was built with, for the bindings to compare with their own. */
#include "isa.h"

/* out[i] = the code of cpu_ops.KIND_NAMES[i] (KIND_CODES lists them in that order); returns how many */
int kind_codes(int64_t *out)
{
    static const int64_t codes[] = KIND_CODES;
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) out[i] = codes[i];
    return (int)(sizeof codes / sizeof codes[0]);
}

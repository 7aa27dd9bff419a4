/* Sizes shared by fastattn's C-level declarations. */
#ifndef FASTATTN_FA_LIMITS_H
#define FASTATTN_FA_LIMITS_H

#include <Python.h>

/* A window side this large (or larger) is no limit at all. */
#define FA_NO_LIMIT (PY_SSIZE_T_MAX / 4)

#endif

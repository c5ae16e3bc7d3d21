// Hostile peers against the ucx transport (placeholder, filled below).
#include <gtest/gtest.h>

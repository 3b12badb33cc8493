#include <stdexcept>
#include "ops/common.h"
namespace simdnorm {
void mean_variance_normalization(const MvnArgs&) { throw std::logic_error("mvn: not built yet"); }
}

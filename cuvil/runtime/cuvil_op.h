/* cuvil_op.h: the C ABI between a cuvil model library and the custom-op kernels linked into it
 * ([tool.cuvil.custom-ops.<name>] in pyproject.toml; docs/custom-ops.md).
 *
 * A kernel is one function, named by the table's `function` key (default: the table's name):
 *
 *     #include "cuvil_op.h"
 *     int soft_clip(const cuvil_op_context *ctx) { ...; return 0; }
 *
 * The model calls it once per node and run, on the calling thread, with the node's tensors
 * and attributes. It returns 0 on success; any other value stops the run, and the model's
 * call raises an error naming the node. The kernel must not keep pointers past its return,
 * and must be re-entrant: several threads may run the same model at once.
 *
 * Tensors are in the order of the signature's inputs, then outputs, with the declared dtypes.
 * Outputs are allocated by cuvil with the shape the shape rule gave; the kernel writes every
 * element. Strides are in elements (not bytes); cuvil passes row-major contiguous tensors, but a
 * kernel that reads strides stays correct if later versions pass views. Attributes are every
 * declared one, in declaration order, with defaults filled in. The workspace holds
 * `workspace` bytes (the table's expression), 64-byte aligned, uninitialised, or is NULL when
 * none was asked for.
 *
 * The structs below are laid out for 64-bit targets with natural alignment; their layout
 * only changes with CUVIL_OP_ABI_VERSION. */
#ifndef CUVIL_OP_H
#define CUVIL_OP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUVIL_OP_ABI_VERSION 1

/* element types: ONNX's TensorProto.DataType numbers */
enum cuvil_dtype {
    CUVIL_FLOAT32 = 1,
    CUVIL_UINT8 = 2,
    CUVIL_INT8 = 3,
    CUVIL_UINT16 = 4,
    CUVIL_INT16 = 5,
    CUVIL_INT32 = 6,
    CUVIL_INT64 = 7,
    CUVIL_BOOL = 9, /* one byte, 0 or 1 */
    CUVIL_FLOAT16 = 10,
    CUVIL_FLOAT64 = 11,
    CUVIL_UINT32 = 12,
    CUVIL_UINT64 = 13
};

/* attribute types: ONNX's AttributeProto.AttributeType numbers */
enum cuvil_attr_type {
    CUVIL_ATTR_FLOAT = 1,
    CUVIL_ATTR_INT = 2,
    CUVIL_ATTR_STRING = 3,
    CUVIL_ATTR_FLOATS = 6,
    CUVIL_ATTR_INTS = 7
};

typedef struct cuvil_tensor {
    void *data;             /* the first element */
    const int64_t *shape;   /* rank dims */
    const int64_t *strides; /* rank strides, in elements */
    int32_t dtype;          /* enum cuvil_dtype */
    int32_t rank;
} cuvil_tensor;

typedef struct cuvil_attr {
    const char *name;
    const char *s;         /* CUVIL_ATTR_STRING: NUL-terminated, `count` bytes before the NUL */
    const int64_t *ints;   /* CUVIL_ATTR_INTS: `count` values */
    const double *floats;  /* CUVIL_ATTR_FLOATS: `count` values (the model's float32s, widened) */
    int64_t i;             /* CUVIL_ATTR_INT */
    double f;              /* CUVIL_ATTR_FLOAT (widened from the model's float32) */
    int64_t count;
    int32_t type;          /* enum cuvil_attr_type */
    int32_t reserved;
} cuvil_attr;

typedef struct cuvil_op_context {
    int32_t abi_version; /* CUVIL_OP_ABI_VERSION of the cuvil that built the model */
    int32_t num_inputs;
    int32_t num_outputs;
    int32_t num_attrs;
    const cuvil_tensor *inputs;
    const cuvil_tensor *outputs; /* their data is written by the kernel */
    const cuvil_attr *attrs;
    void *workspace;
    int64_t workspace_size;
} cuvil_op_context;

/* The attribute `name`, or NULL. */
static inline const cuvil_attr *cuvil_op_attr(const cuvil_op_context *ctx, const char *name) {
    for (int32_t i = 0; i < ctx->num_attrs; i++)
        if (strcmp(ctx->attrs[i].name, name) == 0) return &ctx->attrs[i];
    return NULL;
}

/* Elements of a tensor (the product of its dims). */
static inline int64_t cuvil_op_size(const cuvil_tensor *t) {
    int64_t n = 1;
    for (int32_t i = 0; i < t->rank; i++) n *= t->shape[i];
    return n;
}

#ifdef __cplusplus
}
#endif

#endif /* CUVIL_OP_H */

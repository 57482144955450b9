// Stub of <dispatch/dispatch.h> (Objective-C flavour: dispatch objects are
// Objective-C objects): see ../README.md.
#pragma once
#include <stddef.h>

@protocol OS_dispatch_object
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
@protocol OS_dispatch_data <OS_dispatch_object>
@end
typedef id<OS_dispatch_queue> dispatch_queue_t;
typedef id<OS_dispatch_data> dispatch_data_t;
typedef void (^dispatch_block_t)(void);

#define DISPATCH_DATA_DESTRUCTOR_DEFAULT NULL

#ifdef __cplusplus
extern "C" {
#endif
dispatch_data_t _Nonnull dispatch_data_create(const void* _Nonnull buffer, size_t size,
                                              dispatch_queue_t _Nullable queue,
                                              dispatch_block_t _Nullable destructor);
void dispatch_sync(dispatch_queue_t _Nonnull queue, dispatch_block_t _Nonnull block);
#ifdef __cplusplus
}
#endif

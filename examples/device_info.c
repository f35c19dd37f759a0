/* Prints what hostembed reads off each CUDA device: the attributes its placements decide on. */
#include "hostembed.h"
#include <stdio.h>

int main(void) {
    for (int32_t dev = 0;; dev++) {
        struct engine_device_info info;
        engine_status s = engine_device_info(dev, &info);
        if (s != ENGINE_STATUS_OK) {
            if (dev == 0) {
                printf("no device: %s: %s\n", engine_status_str(s), engine_last_error());
                return s == ENGINE_STATUS_NO_CUDA || s == ENGINE_STATUS_NO_DEVICE ? 0 : 1;
            }
            return 0;
        }
        printf("device %d: %s, sm %d.%d, %d SMs, driver %d, runtime %d\n", dev, info.name, info.compute_major,
               info.compute_minor, info.multiprocessors, info.driver_version, info.runtime_version);
        printf("  total %.2f GiB, free %.2f GiB\n", info.total_bytes / 1073741824.0, info.free_bytes / 1073741824.0);
        printf("  integrated %d, canMapHostMemory %d, pageableMemoryAccess %d, "
               "pageableMemoryAccessUsesHostPageTables %d\n",
               info.integrated, info.can_map_host_memory, info.pageable_memory_access,
               info.pageable_memory_access_uses_host_page_tables);
        printf("  hostRegisterSupported %d, hostRegisterReadOnlySupported %d, canUseHostPointerForRegisteredMem %d\n",
               info.host_register_supported, info.host_register_read_only_supported,
               info.can_use_host_pointer_for_registered_mem);
    }
}

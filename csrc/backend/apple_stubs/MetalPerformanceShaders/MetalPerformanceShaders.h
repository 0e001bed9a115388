#pragma once
#import <Metal/Metal.h>
@interface MPSCommandBuffer : NSObject
@end
